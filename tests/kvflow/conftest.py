import os
import sys

# prefill_proc.py is imported by spawned children too: make this folder importable for them.
sys.path.insert(0, os.path.dirname(__file__))
