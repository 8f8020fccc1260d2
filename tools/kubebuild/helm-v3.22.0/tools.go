//go:build tools

// Package tools names the main packages this wrapper module builds, so that
// go mod tidy keeps their dependencies.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
