// Command kstatus prints the kstatus reading (Current, InProgress, Failed, ...) of one Kubernetes object given as
// JSON on stdin (`kubectl get -o json KIND NAME`), as sigs.k8s.io/cli-utils computes it: the reader behind Flux's
// health checks. Output: the status, a tab, its message. The e2e tests build and run it (tests/test_e2e_operator).
package main

import (
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(2, "reading stdin: %v", err)
	}
	object := &unstructured.Unstructured{}
	if err := object.UnmarshalJSON(data); err != nil { // keeps integers int64, as the API machinery expects
		fail(2, "decoding the object: %v", err)
	}
	result, err := status.Compute(object)
	if err != nil {
		fail(1, "%v", err)
	}
	fmt.Printf("%s\t%s\n", result.Status, result.Message)
}

func fail(code int, format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kstatus: "+format+"\n", args...)
	os.Exit(code)
}
