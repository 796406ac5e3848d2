import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/e2e: shared helpers of the e2e modules
