"""Torch-free pieces the engine server and the router share: the error classes and their HTTP answers, JSON logs,
settings tables, serving an aiohttp app until a signal. Nothing here imports the engine core, the server or torch.
"""
