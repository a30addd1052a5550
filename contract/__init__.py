"""What the operator, the router and the engine agree on, torch-free: the adapter load request and the source rules
(`load`, `sources`), the error classes and their HTTP answers, JSON logs, settings tables, serving an aiohttp app
until a signal. Nothing here imports the operator, the router, the engine or torch.
"""
