"""A small kubelet that runs the pods bound to its node as local processes.

Test and demo infrastructure only: standard library, no part of the `kubelora` package.
"""
