// etcd, built from the published go.etcd.io/etcd/server/v3 module at the version pinned in
// go.mod (ci/k8s/versions.env). Upstream's own main (go.etcd.io/etcd/v3, the repository root) is
// not a published module, and the server module's go.mod has relative replaces, so this
// wrapper is the main: it does what upstream's main.go does.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
