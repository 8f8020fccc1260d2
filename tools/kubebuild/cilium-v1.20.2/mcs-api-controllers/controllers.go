// Package controllers stands in for sigs.k8s.io/mcs-api/controllers v0.5.2 (not served by the
// module proxy) in the cilium build: cilium's clustermesh and gateway-api code read and write
// this annotation on ServiceImports. Its value is the Multi-Cluster Services API's name for it.
package controllers

// DerivedServiceAnnotation names, on a ServiceImport, the Service derived from it.
const DerivedServiceAnnotation = "multicluster.kubernetes.io/derived-service"
