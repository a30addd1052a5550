"""`e2e/cluster`: a real Kubernetes control plane on this machine."""
