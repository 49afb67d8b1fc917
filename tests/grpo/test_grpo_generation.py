"""Generation without lockstep: under ODC, FSDP2's no-grad forwards gather peers' shards one-sidedly, so each rank
runs ``generate()`` on its own prompts to its own length (``synced_gpus=False``). Rank 1 does not even start
generating until rank 0 has finished (an event, not a clock: with collectives rank 0 could not finish alone), the
tokens equal an unsharded replica's, and the training step that follows gives the same parameters as the replica
trained on both ranks' sequences."""

from __future__ import annotations

from odc_hf.testing import run_ranks

NEW_TOKENS = (3, 48)  # different lengths: ranks finish generating at different times


def _generate_and_train(rank: int, world_size: int, events: str):
    import copy
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM

    from odc_hf.fsdp import install_odc, shard_model
    from odc_hf.testing.data import tiny_qwen2_config

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(256, pad_token_id=0, eos_token_id=1))
    replica = copy.deepcopy(model)
    shard_model(model)
    odc = install_odc(model, timeout_s=60)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    odc.attach_optimizer(optimizer)
    replica_optimizer = torch.optim.SGD(replica.parameters(), lr=0.5)
    generated = []
    for round_ in range(2):  # generate, train, generate again with the new weights, train
        gen = torch.Generator().manual_seed(100 + 10 * round_ + rank)
        prompt = torch.randint(3, 256, (2, 4 + 5 * rank), generator=gen)  # different prompts and lengths
        new = NEW_TOKENS[rank]
        kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0)  # fmt: skip
        done = Path(events, f"rank0-generated-round{round_}")
        if rank == 1:  # wait, outside any collective, until rank 0 has generated everything alone
            deadline = time.monotonic() + 120
            while not done.exists():
                assert time.monotonic() < deadline, "rank 0 could not generate while rank 1 stayed out: lockstep"
                time.sleep(0.02)
        with torch.no_grad():
            tokens = model.generate(prompt, synced_gpus=False, **kwargs)
        if rank == 0:
            done.touch()
        generated.append(int(tokens.shape[1] - prompt.shape[1]))
        with torch.no_grad():
            expected = replica.generate(prompt, **kwargs)
        assert torch.equal(tokens, expected), f"rank {rank} round {round_}: generation differs from the replica"
        # One training step on every rank's own sequences; the loss is normalised by the global token count.
        local = int(tokens[:, 1:].numel())
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, tokens)
        total = sum(int(t[:, 1:].numel()) for t in everyone)
        loss = model(input_ids=tokens, labels=tokens).loss * local / total
        loss.backward()
        odc.finish_minibatch(local)
        optimizer.step()
        optimizer.zero_grad()
        replica_loss = sum(replica(input_ids=t, labels=t).loss * t[:, 1:].numel() / total for t in everyone)
        replica_loss.backward()
        replica_optimizer.step()
        replica_optimizer.zero_grad()
        for (name, p), q in zip(model.named_parameters(), replica.parameters()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    odc.close()
    return generated


def test_ranks_generate_to_different_lengths_without_lockstep_then_train_in_step(tmp_path):
    # Each round rank 0 generated all its tokens while rank 1 waited outside generate(); then rank 1 generated its own.
    assert run_ranks(_generate_and_train, 2, str(tmp_path), timeout_s=240) == [[3, 3], [48, 48]]
