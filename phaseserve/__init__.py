"""phaseserve: the one import package of the server.

This folder is the shared ground (wire contract, settings, Redis, models, logging); the services' folders at
the repository's top (gateway/, scheduler/, workers/, kernels/) and the composers (stack/) install inside it
as phaseserve.gateway, phaseserve.scheduler, ... (setup.py), so nothing of ours is a top-level name that
another distribution also writes."""

__version__ = "0.1.0"
