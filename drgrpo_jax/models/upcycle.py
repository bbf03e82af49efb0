"""Sparse upcycling: a dense Llama turned into a Mixtral whose every expert is a copy of the dense MLP.

    python -m drgrpo_jax.models.upcycle SRC OUT --experts 4 --top-k 2 [--seed 0] [--router-std 0.02]

Mixtral is Llama's attention with a softmax top-k mixture whose k weights are renormalised to sum to 1, so with
identical experts every routing gives the dense MLP's output: the upcycled model is the same function at step 0.
The router is fresh (normal, `router_std`), so tokens reach different experts, whose gradients then differ and
whose weights diverge as it trains. SRC: what `from_pretrained` reads (an HF folder, a .gguf file, a Hub id,
pkg:PACKAGE); OUT: an HF folder, tokenizer included, that the trainer and transformers load. A source that cannot
be read or upcycled ends in one line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import numpy as np
from flax import nnx

from drgrpo_jax.hosts import host_array
from drgrpo_jax.models.families import FAMILIES, Family
from drgrpo_jax.models.hf_io import build_model, save_pretrained
from drgrpo_jax.models.pretrained import from_pretrained, load_tokenizer
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.seeds import init_key

__all__ = ["upcycle"]

# Our dense MLP's parameter -> the experts' parameter that stacks its copies.
_EXPERT_OF = {"blocks/gate_proj": "blocks/expert_gate", "blocks/up_proj": "blocks/expert_up",
              "blocks/down_proj": "blocks/expert_down"}


def _has_mixtral_layers(family: Family) -> bool:
    """A dense family whose layers are Mixtral's but for the MLP (Llama's): its HF tensors name them alike."""
    mixtral = FAMILIES["mixtral"]
    return not family.sparse and all(getattr(family, trait) == getattr(mixtral, trait) for trait in (
        "qk_norm", "attention_sinks", "norm_plus_one", "sandwich_norms", "scale_embeddings", "local_rope"))


def upcycle(source: str | Transformer, num_experts: int, experts_per_token: int, seed: int = 0,
            router_std: float = 0.02) -> Transformer:
    """A Mixtral of `num_experts` copies of `source`'s MLP, `experts_per_token` per token, with a router drawn
    from N(0, router_std^2) by `seed`; in the source's dtype. ValueError when the source is not a dense Llama
    without attention biases (Mixtral has neither q/k norms nor biases)."""
    dense = from_pretrained(source) if isinstance(source, str) else source
    config = dense.config
    if not _has_mixtral_layers(config.traits) or config.qkv_bias or config.o_bias:
        raise ValueError(f"upcycle: the source must be a dense Llama without attention biases (Mixtral's attention), "
                         f"got {config.family}{' with attention biases' if config.qkv_bias or config.o_bias else ''}")
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(f"upcycle: --top-k must be in [1, --experts={num_experts}], got {experts_per_token}")
    mixture = dataclasses.replace(config, family="mixtral", num_experts=num_experts,
                                  experts_per_token=experts_per_token,
                                  moe_intermediate_size=config.intermediate_size, norm_topk_prob=True)
    _, state = nnx.split(dense)
    arrays = {"/".join(str(p) for p in path): host_array(v[...]) for path, v in nnx.to_flat_state(state)}
    dtype = arrays["embed"].dtype
    for name, expert in _EXPERT_OF.items():
        arrays[expert] = np.repeat(arrays.pop(name)[:, None], num_experts, axis=1)  # [L, X, Y] -> [L, e, X, Y]
    L, D = config.num_layers, config.hidden_size
    router_LDe = router_std * jax.random.normal(init_key(seed), (L, D, num_experts))
    arrays["blocks/router"] = np.asarray(router_LDe).astype(dtype)
    return build_model(mixture, arrays.__getitem__, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m drgrpo_jax.models.upcycle", description=__doc__.splitlines()[0])
    parser.add_argument("source", metavar="SRC", help="a dense Llama: HF folder, .gguf file, Hub id or pkg:PACKAGE")
    parser.add_argument("out", metavar="OUT", help="the HF folder to write the mixture to")
    parser.add_argument("--experts", type=int, default=4, help="experts per layer, each a copy of the dense MLP")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh router")
    parser.add_argument("--router-std", type=float, default=0.02, help="standard deviation of the router's weights")
    args = parser.parse_args(argv)
    try:  # the source resolves as every command's model does (hub_ids.local_model: a Hub id, pkg:PACKAGE)
        model = upcycle(args.source, args.experts, args.top_k, args.seed, args.router_std)
        tokenizer = load_tokenizer(args.source, None)
    except (OSError, ValueError) as error:  # ConfigError and the loaders' one-line checks are ValueErrors
        sys.stderr.write(f"{parser.prog}: error: SRC {args.source}: {' '.join(str(error).split())}\n")
        sys.exit(2)
    save_pretrained(model, args.out, tokenizer=tokenizer)
    print(f"upcycled {args.source} into {args.experts} experts, top-{args.top_k}: {args.out}")


if __name__ == "__main__":
    main()
