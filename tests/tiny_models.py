"""Random tiny models and a naive greedy reference, shared by the engine tests."""

from __future__ import annotations

import torch

from aggdec.model.config import ModelConfig
from aggdec.model.transformer import Transformer

CONFIGS = {
    "postnorm-sinusoidal-shared": dict(share_all_embeddings=True),
    "prenorm-learned-separate": dict(enc_normalize_before=True, dec_normalize_before=True, enc_learned_pos=True,
                                     dec_learned_pos=True, layernorm_embedding=True, tgt_vocab=17),
    "shallow-decoder-tied-output": dict(enc_layers=3, dec_layers=1, share_decoder_input_output_embed=True, activation="gelu"),
}
FAIRSEQ_CONFIGS = dict(CONFIGS)  # the layouts a fairseq `transformer` checkpoint can have
CONFIGS |= {  # the switches of imported Hugging Face families (aggdec.hf_import)
    "marian-like": dict(share_all_embeddings=True, first_position=0, sinusoidal="marian", activation="silu",
                        output_bias=True),
    "bart-like": dict(share_all_embeddings=True, enc_learned_pos=True, dec_learned_pos=True, first_position=2,
                      layernorm_embedding=True, output_bias=True, max_source_positions=70),
}
T5 = dict(share_all_embeddings=True, no_scale_embedding=True, enc_normalize_before=True, dec_normalize_before=True,
          norm="rms", norm_eps=1e-6, linear_bias=False, head_dim=6, attention_scale=False, relative_buckets=8,
          relative_max_distance=12, pad=0, eos=1, unk=2, bos=1)
CONFIGS |= {  # T5's layouts: relative position buckets (short: distances past 12 share the last), RMS norms, ...
    "t5-like": T5 | dict(output_scale=16**-0.5),  # v1.0: ReLU, the output tied and rescaled
    "t5-gated-like": T5 | dict(activation="gelu_tanh", gated_ffn=True, untied_output=True,  # v1.1, mT5; and
                               relative_per_layer=True, dec_layers=3),  # umT5's bias table per layer
}
MODELS = CONFIGS | {  # models whose outputs are not single-token greedy's
    "double-token": dict(share_all_embeddings=True, dec_learned_pos=True, double_token=True),  # aggdec.double_token
}


def tiny_model(kind: str = "postnorm-sinusoidal-shared", seed: int = 0, vocab: int = 13, **over) -> Transformer:
    """A random float64 model in eval mode. Small vocab makes repeats and early eos likely."""
    torch.manual_seed(seed)
    kw = dict(src_vocab=vocab, tgt_vocab=vocab, d_model=16, enc_layers=2, dec_layers=2, enc_heads=2, dec_heads=2,
              enc_ffn=24, dec_ffn=24, max_source_positions=64, max_target_positions=64)
    kw.update(MODELS[kind])
    kw.update(over)
    model = Transformer(ModelConfig(**kw)).double().eval()
    # Sharpen the output distribution so greedy outputs have structure (copies, repeats, eos).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
        if model.output_bias is not None:
            model.output_bias.normal_(0, 1.0)
    return model


@torch.no_grad()
def naive_greedy(model: Transformer, src: list[int], max_len: int, prompt: tuple[int, ...] | None = None) -> list[int]:
    """Greedy by full recomputation of the whole prefix at every step (no cache), fairseq rules;
    `prompt` = (decoder start, forced first tokens...), default (eos,)."""
    cfg = model.cfg
    prompt = prompt or (cfg.eos,)
    out = [prompt[0]]
    for step in range(max_len + 1):
        logits = model(torch.tensor([src]), torch.tensor([out]))[0, -1].clone()
        logits[cfg.pad] = -float("inf")
        if step < 1:
            logits[cfg.eos] = -float("inf")
        tok = cfg.eos if step >= max_len else int(logits.argmax())
        if step < len(prompt) - 1:
            tok = prompt[1 + step]
        if tok == cfg.eos:
            break
        out.append(tok)
    return out[1:]
