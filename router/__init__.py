"""Adapter-affinity router that fronts a LoRAPool: sends each request to a replica holding its adapter."""
