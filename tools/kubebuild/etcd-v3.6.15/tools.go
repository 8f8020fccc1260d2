//go:build tools

// Package tools names the main packages this wrapper module builds, so that
// go mod tidy keeps their dependencies.
package tools

import (
	_ "go.etcd.io/etcd/etcdctl/v3"
	_ "go.etcd.io/etcd/etcdutl/v3"
	_ "go.etcd.io/etcd/server/v3"
)
