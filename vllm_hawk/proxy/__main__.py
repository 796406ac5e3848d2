import sys

from vllm_hawk.proxy import main

sys.exit(main())
