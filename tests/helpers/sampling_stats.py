"""A tiny model with peaked next-token distributions, the exact distribution of its first three sampled tokens,
and a chi-square test: the statistical check that speculative sampling emits the target's distribution."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 12
SEED_TEXT = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2]])


def peaked_model(seed, scale=15.0):
    """Tiny model whose next-token distributions are far from uniform (so drafts are often plausible)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@torch.no_grad()
def grounded_prompt(model):
    """Seed text + the model's own greedy continuation: n-gram drafts then carry real target mass."""
    return model.generate(SEED_TEXT, max_new_tokens=20, do_sample=False)


def processors_of(model, prompt, options):
    """The logits processors plain generate builds for these options (captured by a custom_generate callable)."""
    captured = {}

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        captured["processors"] = logits_processor
        return input_ids

    model.generate(prompt, custom_generate=capture, **dict(options, max_new_tokens=3))
    return captured["processors"]


@torch.no_grad()
def exact_joint(model, prompt, options):
    """P(t1, t2, t3) [V, V, V] under plain sampling with the processors plain generate builds."""
    process = processors_of(model, prompt, options)
    joint = torch.ones(1)
    prefixes = prompt
    for _ in range(3):
        logits = model(prefixes).logits[:, -1].float()
        scores = torch.cat([process(row[None], row_logits[None]) for row, row_logits in zip(prefixes, logits)])
        probs = torch.softmax(scores, dim=-1)  # [n, V]
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], 1)
    return joint.view(VOCAB, VOCAB, VOCAB)


def chi_square_p_value(counts, probs):
    """Pearson chi-square; cells with expected count < 5 are pooled into one cell."""
    expected = probs.reshape(-1).double() * counts.sum()
    counts = counts.double()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()
