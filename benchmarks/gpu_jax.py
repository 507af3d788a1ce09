"""The JAX part of benchmarks/gpu.py, run by it as a child process (its own GPU memory; a crash
here costs only this section): batches/s of ``tokenmill.jax.to_jax(loader, sharding)`` against
``jax.device_put(batch, sharding)`` per step, or why that was skipped.

    python benchmarks/gpu_jax.py STORE --out PATH --vocab N --setup JSON   # gpu.py runs this

It writes its results as JSON to ``--out`` (atomically): ``{"skipped": why}`` when jax does not
import or (outside a dry run) sees no GPU, else the facts jax gives about its device and, per path,
the medians and repeats of ``feed_batches_per_s`` and ``step_batches_per_s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # noqa: E402 - the setup, feeds and progress lines of benchmarks/gpu.py
from gpu import Feed, Setup, close_feeds, say  # noqa: E402


def jax_measure(store: str, vocab: int, setup: Setup) -> dict[str, Any]:
    """to_jax against device_put per step, or why it was skipped."""
    try:
        import jax
    except Exception as e:  # not installed, or a plugin that fails at import
        return {"skipped": f"jax does not import here ({type(e).__name__}: {e})"}
    import jaxlib
    try:
        devices = jax.devices()
    except Exception as e:  # a backend asked for (JAX_PLATFORMS) that fails to start
        return {"skipped": f"jax {jax.__version__} starts no backend ({type(e).__name__}: {e})"}
    facts = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
             "backend": jax.default_backend(), "devices": [str(d) for d in devices],
             "device_kind": devices[0].device_kind}
    gpus = [d for d in devices if d.platform == "gpu"]
    if not gpus and not setup.dry_run:
        return {"skipped": f"jax {jax.__version__} sees no GPU (backend "
                           f"{jax.default_backend()!r}, devices {facts['devices']})",
                "facts": facts}
    say(f"jax {jax.__version__}: {facts['device_kind']} ({facts['backend']})")
    device = (gpus or devices)[0]
    result = jax_compare(store, vocab, setup, device)
    return {"facts": facts, "method": JAX_METHOD, **result}


JAX_METHOD = ("batches/s over a window of steps: 'feed' waits for each batch "
              "(jax.block_until_ready), 'step' runs a jitted MLP language-model step on each "
              "and waits for its loss; loader dtype int32, concat layout")


def jax_compare(store: str, vocab: int, setup: Setup, device) -> dict[str, Any]:
    """Warm-up, then repeats of (feed window, step window) for each path; medians."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    sharding = NamedSharding(Mesh(np.array([device]), ("data",)), PartitionSpec("data"))
    step, params = jax_model(setup, vocab, device)
    feeds = jax_feeds(store, setup, sharding)
    try:
        for feed in feeds.values():
            for _ in range(setup.warmup):
                batch = next(feed.batches)
                params, loss = step(params, batch["inputs"], batch["targets"])
            loss.block_until_ready()
        runs: dict[str, list[dict]] = {name: [] for name in feeds}
        for r in range(setup.repeats):
            for name, feed in feeds.items():
                feed_rate, _ = jax_window(feed.batches, setup.steps)
                step_rate, params = jax_window(feed.batches, setup.steps, step, params)
                runs[name].append({"feed_batches_per_s": feed_rate,
                                   "step_batches_per_s": step_rate})
                say(f"jax    {name:10} repeat {r + 1}/{setup.repeats}: feed {feed_rate:,.1f} "
                    f"batches/s, step {step_rate:,.1f} batches/s")
        out: dict[str, Any] = {}
        for name, rs in runs.items():
            out[name] = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            out[name]["repeats"] = rs
        for k in ("feed_batches_per_s", "step_batches_per_s"):
            out[f"ratio_{k}"] = out["to_jax"][k] / out["device_put"][k]
        return out
    finally:
        close_feeds(feeds)


def jax_feeds(store: str, setup: Setup, sharding) -> dict[str, Feed]:
    """``jax.device_put`` of each batch, and ``to_jax``, over two loaders of the same settings."""
    import jax
    from tokenmill import Loader
    from tokenmill.jax import to_jax

    def loader():
        return Loader(store, seq_len=setup.seq_len, batch_size=setup.batch_size, seed=0,
                      dtype="int32")

    plain = loader()
    put = (jax.device_put(arrays, sharding) for arrays in plain)
    wrapped = to_jax(loader(), sharding)

    def close_put():
        put.close()
        plain.close()

    return {"device_put": Feed(put, plain, close_put),
            "to_jax": Feed(iter(wrapped), wrapped.loader, wrapped.close)}


def jax_window(batches, steps: int, step=None, params=None) -> tuple[float, Any]:
    """Batches/s over ``steps`` batches: each waited for, or stepped on and its loss waited for."""
    import jax
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        if step is None:
            jax.block_until_ready(batch)
        else:
            params, loss = step(params, batch["inputs"], batch["targets"])
            loss.block_until_ready()
    return steps / (time.perf_counter() - t0), params


def jax_model(setup: Setup, vocab: int, device):
    """A jitted SGD step of an MLP language model (embedding, residual GELU MLPs, head; fp32
    weights, bf16 matmuls on a GPU)."""
    import jax
    import jax.numpy as jnp
    d, n = setup.d_model, setup.n_layers
    keys = jax.random.split(jax.random.key(0), 2 * n + 2)

    def init(i, shape):
        return jax.random.normal(keys[i], shape, jnp.float32) * 0.02

    params = {"emb": init(0, (vocab, d)), "head": init(1, (d, vocab)),
              "blocks": [(init(2 + 2 * i, (d, 4 * d)), init(3 + 2 * i, (4 * d, d)))
                         for i in range(n)]}

    dt = jnp.float32 if setup.dry_run else jnp.bfloat16  # as the torch GPT: bf16 on the GPU

    def loss_fn(p, inputs, targets):
        x = p["emb"][inputs].astype(dt)
        for w1, w2 in p["blocks"]:
            x = x + jax.nn.gelu(x @ w1.astype(dt)) @ w2.astype(dt)
        logits = (x @ p["head"].astype(dt)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    @jax.jit
    def step(p, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(p, inputs, targets)
        return jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads), loss

    return step, jax.device_put(params, device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--setup", required=True, help="gpu.py's Setup as JSON")
    ap.add_argument("--elapsed", type=float, default=0.0, help="the parent's seconds so far")
    args = ap.parse_args(argv)
    gpu.START_OFFSET_S[0] = args.elapsed  # progress lines on the parent's clock
    from tokenmill.base.io import atomic_write_json
    result = jax_measure(args.store, args.vocab, Setup(**json.loads(args.setup)))
    atomic_write_json(args.out, gpu.jsonable(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
