"""`python -m actx.deploy.host_run`: the hosts' entry point under the name that TPU plans
have always printed (docs/tpu-pod.md); the code is deploy/detached/host_run.py."""

import sys

from actx.deploy.detached.host_run import main

if __name__ == "__main__":
    sys.exit(main())
