"""destroy_gloo_group_at_exit: the default gloo group is destroyed by an atexit handler, once, while the interpreter
is whole (the guard against gloo's exit-time abort, pytorch/pytorch#190489). Run in a fresh interpreter because the
handler acts at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import atexit, tempfile
    import torch.distributed as dist
    from odc_hf.integrations.launch.exit_cleanup import destroy_gloo_group_at_exit

    print("before init", destroy_gloo_group_at_exit())  # nothing to destroy yet: not registered
    # registered first, so it runs after odc_hf's handler (atexit is last in, first out)
    atexit.register(lambda: print("initialized at exit", dist.is_initialized(), flush=True))
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    print("registered", destroy_gloo_group_at_exit(), destroy_gloo_group_at_exit())
    gathered = [None]
    dist.all_gather_object(gathered, {"rank": 0})
    print("gathered", gathered, flush=True)
    """
)


def test_gloo_group_destroyed_at_exit_once():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["before init False", "registered True True", "gathered [{'rank': 0}]", "initialized at exit False"]
