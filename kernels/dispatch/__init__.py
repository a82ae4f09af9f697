"""The dispatch's parts, one file per op family, re-exported by kernels/__init__.py (the one place callers
import ops from). choices.py holds every choice they make, resolved once per process and key."""
