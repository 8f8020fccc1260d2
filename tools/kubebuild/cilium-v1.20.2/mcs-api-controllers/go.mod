// In place of sigs.k8s.io/mcs-api/controllers v0.5.2, which the module proxy does not serve:
// the one name cilium v1.20.2 uses from it outside its tests (tools/kubebuild/cilium.py).
module sigs.k8s.io/mcs-api/controllers

go 1.24
