"""Save a sharded checkpoint (torch.distributed.checkpoint) after minibatch 2 of an ODC run, load it into a
fresh job, run minibatch 3: parameters equal the uninterrupted run's."""

from __future__ import annotations

from functools import partial

from fsdp_helpers import distributed_run, max_rel_error

from odc_hf.testing import run_ranks

COUNTS = (3, 1)


def test_resume_from_sharded_checkpoint_is_identical(tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(partial(distributed_run, save_after=1, checkpoint_dir=path), 2, COUNTS, 3, "odc")[0]
    resumed = run_ranks(partial(distributed_run, start=2, load_from=path), 2, COUNTS, 3, "odc")[0]
    assert len(resumed) == 1
    assert max_rel_error(resumed[0]["grads"], full[2]["grads"]) == 0.0
    assert max_rel_error(resumed[0]["params"], full[2]["params"]) == 0.0
