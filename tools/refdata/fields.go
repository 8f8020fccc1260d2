// Command fields prints, as JSON, every field path of the config kinds the contract stand-ins
// check, read by reflection from the Go types that the built binaries decode them into (the
// modules pinned in tools/kubebuild/kubernetes-<version>). tools/refdata/generate.py builds it
// inside a copy of that wrapper module, so the paths are those of exactly the version we build.
package main

import (
	"encoding"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	apiserverv1beta1 "k8s.io/apiserver/pkg/apis/apiserver/v1beta1"
	auditv1 "k8s.io/apiserver/pkg/apis/audit/v1"
	kubeproxyv1alpha1 "k8s.io/kube-proxy/config/v1alpha1"
	schedv1 "k8s.io/kube-scheduler/config/v1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
)

type kind struct {
	gv  schema.GroupVersion
	obj any
	pkg string
}

var kinds = map[string]kind{
	"KubeletConfiguration":        {kubeletv1beta1.SchemeGroupVersion, kubeletv1beta1.KubeletConfiguration{}, "k8s.io/kubelet/config/v1beta1"},
	"KubeProxyConfiguration":      {kubeproxyv1alpha1.SchemeGroupVersion, kubeproxyv1alpha1.KubeProxyConfiguration{}, "k8s.io/kube-proxy/config/v1alpha1"},
	"KubeSchedulerConfiguration":  {schedv1.SchemeGroupVersion, schedv1.KubeSchedulerConfiguration{}, "k8s.io/kube-scheduler/config/v1"},
	"Policy":                      {auditv1.SchemeGroupVersion, auditv1.Policy{}, "k8s.io/apiserver/pkg/apis/audit/v1"},
	"EncryptionConfiguration":     {apiserverv1.SchemeGroupVersion, apiserverv1.EncryptionConfiguration{}, "k8s.io/apiserver/pkg/apis/apiserver/v1"},
	"AdmissionConfiguration":      {apiserverv1.SchemeGroupVersion, apiserverv1.AdmissionConfiguration{}, "k8s.io/apiserver/pkg/apis/apiserver/v1"},
	"AuthenticationConfiguration": {apiserverv1.SchemeGroupVersion, apiserverv1.AuthenticationConfiguration{}, "k8s.io/apiserver/pkg/apis/apiserver/v1"},
	"AuthorizationConfiguration":  {apiserverv1.SchemeGroupVersion, apiserverv1.AuthorizationConfiguration{}, "k8s.io/apiserver/pkg/apis/apiserver/v1"},
	"EgressSelectorConfiguration": {apiserverv1beta1.SchemeGroupVersion, apiserverv1beta1.EgressSelectorConfiguration{}, "k8s.io/apiserver/pkg/apis/apiserver/v1beta1"},
}

// The scheduler decodes profiles.pluginConfig.args into the plugin's own *Args kind: the
// stand-in accepts a field of any of them there (which plugin takes which is the real binary's
// check, tests/test_real_flags.py).
var schedulerArgs = []any{
	schedv1.DefaultPreemptionArgs{}, schedv1.DynamicResourcesArgs{}, schedv1.InterPodAffinityArgs{},
	schedv1.NodeAffinityArgs{}, schedv1.NodeResourcesBalancedAllocationArgs{}, schedv1.NodeResourcesFitArgs{},
	schedv1.PodTopologySpreadArgs{}, schedv1.VolumeBindingArgs{},
}

// Free-form below this point: the decoder does not know the content's type.
var opaqueTypes = map[reflect.Type]string{
	reflect.TypeOf(runtime.RawExtension{}): "runtime.RawExtension",
	reflect.TypeOf(runtime.Unknown{}):      "runtime.Unknown",
	reflect.TypeOf(metav1.ObjectMeta{}):    "meta/v1.ObjectMeta",
}

var (
	jsonUnmarshaler = reflect.TypeOf((*json.Unmarshaler)(nil)).Elem()
	textUnmarshaler = reflect.TypeOf((*encoding.TextUnmarshaler)(nil)).Elem()
)

type out struct {
	APIVersion string            `json:"apiVersion"`
	Package    string            `json:"package"`
	Paths      []string          `json:"paths"`
	Opaque     map[string]string `json:"opaque"`
}

type walker struct {
	kind   string
	paths  map[string]bool
	opaque map[string]string
}

func (w *walker) walk(t reflect.Type, prefix string, stack []reflect.Type) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if why, ok := opaqueTypes[t]; ok {
		if w.kind == "KubeSchedulerConfiguration" && prefix == "profiles.pluginConfig.args" {
			for _, a := range schedulerArgs {
				w.walk(reflect.TypeOf(a), prefix, stack)
			}
			return
		}
		w.opaque[prefix] = why
		return
	}
	// a type with its own decoding (Duration, Quantity, Time, ...) is one scalar value
	if reflect.PointerTo(t).Implements(jsonUnmarshaler) || reflect.PointerTo(t).Implements(textUnmarshaler) {
		return
	}
	for _, s := range stack {
		if s == t {
			panic(fmt.Sprintf("%s: recursive type %s at %s", w.kind, t, prefix))
		}
	}
	stack = append(stack, t)
	switch t.Kind() {
	case reflect.Map:
		w.opaque[prefix] = t.String()
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() != reflect.Uint8 { // []byte is one base64 string
			w.walk(t.Elem(), prefix, stack) // list items hang off the list's own path
		}
	case reflect.Struct:
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			if !f.IsExported() {
				continue
			}
			name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "-" {
				continue
			}
			if (f.Anonymous && name == "") || strings.Contains(","+opts+",", ",inline,") {
				w.walk(f.Type, prefix, stack)
				continue
			}
			if name == "" {
				name = f.Name
			}
			p := name
			if prefix != "" {
				p = prefix + "." + name
			}
			w.paths[p] = true
			w.walk(f.Type, p, stack)
		}
	}
}

func main() {
	result := map[string]out{}
	for name, k := range kinds {
		w := &walker{kind: name, paths: map[string]bool{}, opaque: map[string]string{}}
		w.walk(reflect.TypeOf(k.obj), "", nil)
		paths := make([]string, 0, len(w.paths))
		for p := range w.paths {
			paths = append(paths, p)
		}
		sort.Strings(paths)
		result[name] = out{k.gv.String(), k.pkg, paths, w.opaque}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(result); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
