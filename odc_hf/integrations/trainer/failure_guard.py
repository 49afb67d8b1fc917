"""``odc_hf.failure_guard``: one rank's exception, reported to every peer within a second.

    with odc_hf.failure_guard(accelerator):      # or an ODCHandle; wrap the whole loop (or each step)
        for bundle in loader:
            ...  # forward/backward, finish_minibatch, clip, optimizer step, logging, saving

On an exception inside, this rank writes ``"<type>: <message>"`` where its peers look (ODC's control block) and
closes its connections to them, so a peer waiting at an ODC barrier *or* blocked in a torch.distributed collective
(a gloo all-reduce, ``clip_grad_norm_``, ``DTensor.full_tensor``) raises
``PeerFailedError: rank <r> failed (<type>: <message>); ...`` at once, whether this process then exits or lives on
(an exception caught by user code, a notebook cell). A rank whose exception came from a peer raises that
``PeerFailedError`` (chained to its own error) instead of reporting one of its own. How and why:
:mod:`odc_hf.transport.failures`. The ODC trainers put their whole ``train()`` / ``evaluate()`` under it.

The handle is looked up when an exception arrives, so the guard may be entered before ``prepare()`` installs ODC;
before that (or without ODC: one process, ``enabled=False``) it only re-raises.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def failure_guard(target):
    """Report an exception raised inside to every peer (see the module docstring). ``target``: an Accelerator that
    ``odc_hf.prepare`` / ``ODCAccelerator`` set up (its ``.odc`` handle), an ``ODCHandle``, or a callable returning
    either (or ``None``)."""
    try:
        yield
    except BaseException:
        handle = _handle(target)
        if handle is None:
            raise
        with handle.failure_guard():  # reports the exception being handled, then re-raises it (or a PeerFailedError)
            raise


def _handle(target):
    if callable(target) and not hasattr(target, "failure_guard") and not hasattr(target, "odc"):
        target = target()
    return target if hasattr(target, "failure_guard") else getattr(target, "odc", None)


__all__ = ["failure_guard"]
