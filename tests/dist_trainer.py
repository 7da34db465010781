"""Trainer side of the distributed malformed-request cases: rank 0 of a gloo update group, broadcasting a plan.

Usage: python tests/dist_trainer.py PLAN.pt PORT. The plan is a list, one entry per distributed case: the tensors
to broadcast in order, or None when the engine refuses the request before receiving (then nothing is sent).
"""

from __future__ import annotations

import os
import sys

import torch

from sglang_fp8rl.cpu_runner import install_cpu_stubs

install_cpu_stubs()


def main() -> None:
    from sglang.srt.utils import init_custom_process_group
    from update_group import GROUP_TIMEOUT

    plan = torch.load(sys.argv[1], weights_only=False)
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", world_size=2,
                                      rank=0, group_name="fp8rl_test", timeout=GROUP_TIMEOUT)
    for i, tensors in enumerate(plan):
        for tensor in tensors or ():
            torch.distributed.broadcast(tensor, src=0, group=group)
        print(f"case {i}: sent {len(tensors or ())} tensors", flush=True)


if __name__ == "__main__":
    main()
    # every broadcast has returned; leave without running gloo's destructors, whose threads can abort the process at
    # interpreter exit while the engine's end of the group still exists ("terminate called without an active
    # exception", rc -6, seen in a CI-like run after all cases were sent)
    sys.stdout.flush()
    os._exit(0)
