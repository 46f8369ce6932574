"""The next token of every row from its logits, each row under its own parameters and its own random stream.

Order, as transformers' and vLLM's: logit biases, then penalties (repetition over prompt and output, presence and
frequency over the output), then temperature, top-k, top-p, min-p (each on what the previous left), then a draw.
The draw is argmax(p / e) with e ~ Exp(1) drawn from the row's own generator (the exponential race, as vLLM draws
per-request seeds): the same as sampling from p, and a row's tokens depend only on its prompt, parameters and seed,
never on the other rows. Log-probabilities are the raw distribution's (vLLM's default). All of it stays on the
logits' device; the tokens and log-probabilities come back packed in one tensor for the step's one broadcast.
"""

from __future__ import annotations

import torch

from moe.generation.params import SamplingParams
from moe.generation.structured import Grammars


class Sampler:
    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], vocab_size: int,
                 device: torch.device, outputs: list[list[int]] | None = None,
                 generators: list[torch.Generator | None] | None = None, eos: tuple[int, ...] = (),
                 grammars: Grammars | None = None) -> None:
        """`outputs`: tokens each row generated so far (for the penalties and `min_tokens`), `generators`: rows'
        streams that already drew (a server's sequences, resumed in a new batch); fresh ones are seeded from the
        params. `eos`: the ids that end a sequence, which `min_tokens` holds back. `grammars`: the rows' structured
        output matchers."""
        self.params, self.device, B = params, device, len(params)

        def column(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)[:, None]

        self.sampled = [b for b, p in enumerate(params) if not p.greedy]
        temperature = column("temperature")
        self.greedy_B = temperature[:, 0] == 0
        self.temperature = torch.where(temperature == 0, 1.0, temperature)  # greedy rows take the argmax
        self.filters = any(p.filtered for p in params if not p.greedy)
        self.top_k, self.top_p, self.min_p = column("top_k", torch.long), column("top_p"), column("min_p")
        given = generators or [None] * B
        self.generators = {b: given[b] or seeded(params[b].seed, device) for b in self.sampled}
        outputs = outputs or [[] for _ in params]
        self.repetition = column("repetition_penalty") if any(p.repetition_penalty != 1 for p in params) else None
        self.seen_BV = None
        if self.repetition is not None:  # prompt tokens count for the repetition penalty
            self.seen_BV = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            for b, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
                self.seen_BV[b, torch.tensor(prompt + output, dtype=torch.long, device=device)] = True
        self.counts_BV = None
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            self.counts_BV = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
            for b, output in enumerate(outputs):
                if output:
                    self.counts_BV[b].index_add_(0, torch.tensor(output, device=device), torch.ones(len(output),
                                                                                                     device=device))
            self.presence, self.frequency = column("presence_penalty"), column("frequency_penalty")
        self.ban_BV, self.min_left_B = held_back(params, outputs, eos, vocab_size, device)
        self.bias_BV = logit_biases(params, vocab_size, device)
        self.grammars = grammars
        self.bad_words = BadWords(params, outputs, vocab_size, device) if any(
            len(w) > 1 for p in params for w in p.bad_words_ids) else None
        self.top = top_logprobs(params)
        # every row greedy with nothing to adjust or report: the argmax alone, two ops where the general path takes
        # five (a step's weights have just pushed torch's code out of the caches: each costs 5-15 us on a CPU)
        self.argmax_only = not self.sampled and self.repetition is None and self.counts_BV is None and \
            self.top is None and self.ban_BV is None and self.bias_BV is None and self.bad_words is None and \
            grammars is None

    def __call__(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """[B, packed_width(top_logprobs)] int64: the next token of each row, and its log-probabilities when asked."""
        if self.argmax_only:
            return logits_BV.float().argmax(dim=-1, keepdim=True)
        raw_BV = logits_BV.float()
        logits_BV = self.penalise(raw_BV)
        tokens_B = logits_BV.argmax(dim=-1)
        if self.sampled:
            tokens_B = torch.where(self.greedy_B, tokens_B, self.draw(logits_BV / self.temperature))
        if self.top is None:
            return tokens_B[:, None]
        bits, ids = logprob_bits(raw_BV.log_softmax(dim=-1), tokens_B, self.top)
        return torch.cat([tokens_B[:, None], bits, ids], dim=1)

    def penalise(self, logits_BV: torch.Tensor) -> torch.Tensor:
        if self.bias_BV is not None:
            logits_BV = logits_BV + self.bias_BV
        if self.bad_words is not None:
            logits_BV = self.bad_words.ban(logits_BV)
        if self.grammars is not None:
            logits_BV = self.grammars.mask(logits_BV)
        if self.ban_BV is not None:  # rows short of their min_tokens: no end yet
            logits_BV = logits_BV.masked_fill(self.ban_BV & (self.min_left_B > 0)[:, None], float("-inf"))
        if self.seen_BV is not None:
            scaled = torch.where(logits_BV > 0, logits_BV / self.repetition, logits_BV * self.repetition)
            logits_BV = torch.where(self.seen_BV, scaled, logits_BV)
        if self.counts_BV is not None:
            logits_BV = (logits_BV - self.frequency * self.counts_BV
                         - self.presence * (self.counts_BV > 0).float())
        return logits_BV

    def draw(self, logits_BV: torch.Tensor) -> torch.Tensor:
        order_BV = None
        if self.filters:
            logits_BV, order_BV = self.filter(logits_BV)
        probs_BV = logits_BV.softmax(dim=-1)
        race_BV = torch.ones_like(probs_BV)
        for b, generator in self.generators.items():
            race_BV[b].exponential_(generator=generator)
        chosen_B = (probs_BV / race_BV).argmax(dim=-1)
        return chosen_B if order_BV is None else order_BV.gather(1, chosen_B[:, None])[:, 0]

    def filter(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """top-k, then top-p over what top-k kept, then min-p; in sorted order (returned with the order)."""
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True, stable=True)
        V = sorted_BV.shape[-1]
        rank_V = torch.arange(V, device=logits_BV.device)
        keep_k = torch.where(self.top_k > 0, self.top_k, V)
        sorted_BV = sorted_BV.masked_fill(rank_V >= keep_k, float("-inf"))
        probs_BV = sorted_BV.softmax(dim=-1)
        # a token goes when the tokens before it already cover top_p; the first always stays
        covered = (probs_BV.cumsum(-1) - probs_BV > self.top_p) & (self.top_p < 1)
        sorted_BV = sorted_BV.masked_fill(covered, float("-inf"))
        probs_BV = sorted_BV.softmax(dim=-1)
        sorted_BV = sorted_BV.masked_fill(probs_BV < self.min_p * probs_BV[:, :1], float("-inf"))
        return sorted_BV, order_BV

    def update(self, tokens_B: torch.Tensor, host: list[int] | None = None) -> None:
        """The step's shared tokens join each row's history (for the penalties, `min_tokens`, bad words and, given
        the host's copy, the grammars; a server's batch moves its rows' grammars itself)."""
        if self.grammars is not None and host is not None:
            self.grammars.consume(host)
        if self.bad_words is not None:
            self.bad_words.update(tokens_B)
        if self.min_left_B is not None:
            self.min_left_B.sub_(1).clamp_(min=0)
        if self.seen_BV is not None:
            self.seen_BV.scatter_(1, tokens_B[:, None], True)
        if self.counts_BV is not None:
            self.counts_BV.scatter_add_(1, tokens_B[:, None], torch.ones_like(tokens_B[:, None], dtype=torch.float32))


def seeded(seed: int | None, device: torch.device) -> torch.Generator:
    """A row's random stream: from its seed, or (None) from the system's randomness; only the head's rank draws."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
        return generator
    return generator.manual_seed(seed)


def held_back(params: list[SamplingParams], outputs: list[list[int]], eos: tuple[int, ...], vocab_size: int,
              device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For rows with `min_tokens`: the ids they may not draw yet ([B, V]: their stop tokens, and the end-of-sequence
    ids unless `ignore_eos`, as vLLM's), and how many tokens each has still to make; (None, None) where no row
    asks."""
    if not any(p.min_tokens for p in params):
        return None, None
    ban_BV = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    for b, p in enumerate(params):
        ids = [i for i in (*p.stop_token_ids, *(() if p.ignore_eos else eos)) if 0 <= i < vocab_size]
        ban_BV[b, ids] = True  # held back while the row's min_left_B > 0 (never, without min_tokens)
    left = [max(0, p.min_tokens - len(out)) for p, out in zip(params, outputs, strict=True)]
    return ban_BV.to(device), torch.tensor(left, dtype=torch.long, device=device)


def logit_biases(params: list[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """[B, V]: what each row adds to the raw logits: its `logit_bias`, and -inf on every token outside its
    `allowed_token_ids` and on its one-token bad words (None where no row has any)."""
    if not any(p.logit_bias or p.allowed_token_ids or p.bad_words_ids for p in params):
        return None
    bias_BV = torch.zeros(len(params), vocab_size)
    for b, p in enumerate(params):
        if p.allowed_token_ids:
            bias_BV[b] = float("-inf")
            bias_BV[b, list(p.allowed_token_ids)] = 0.0
        for i, v in p.logit_bias:
            bias_BV[b, i] += v
        bias_BV[b, [w[0] for w in p.bad_words_ids if len(w) == 1]] = float("-inf")
    return bias_BV.to(device)


class BadWords:
    """Bad words of more than one token: a word's last token is held back in a row whose last output tokens spell
    the rest of it (the output's, not the prompt's, as vLLM reads them). Each row's last tokens stay on the logits'
    device, shifted every step, and the match is a few tensor ops: no host sync."""

    def __init__(self, params: list[SamplingParams], outputs: list[list[int]], vocab_size: int,
                 device: torch.device) -> None:
        words = [(b, w) for b, p in enumerate(params) for w in p.bad_words_ids if len(w) > 1]
        self.M, self.V = max(len(w) for _, w in words) - 1, vocab_size
        self.recent_BM = torch.tensor([([-1] * self.M + out)[len(out):] for out in outputs], dtype=torch.long,
                                      device=device).view(len(params), self.M)
        self.groups = []  # per word length: the rows, the words' leading tokens and their last token
        for n in sorted({len(w) for _, w in words}):
            those = [(b, w) for b, w in words if len(w) == n]
            self.groups.append(tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (
                [b for b, _ in those], [w[:-1] for _, w in those], [w[-1] for _, w in those])))

    def ban(self, logits_BV: torch.Tensor) -> torch.Tensor:
        hits_BV = torch.zeros_like(logits_BV)
        for rows_W, lead_WL, last_W in self.groups:
            spelled_W = (self.recent_BM[rows_W, self.M - lead_WL.shape[1]:] == lead_WL).all(dim=-1)
            hits_BV.index_put_((rows_W, last_W), spelled_W.to(hits_BV.dtype), accumulate=True)
        return logits_BV.masked_fill(hits_BV > 0, float("-inf"))

    def update(self, tokens_B: torch.Tensor) -> None:
        self.recent_BM = torch.cat([self.recent_BM[:, 1:], tokens_B.view(-1, 1)], dim=1)


def top_logprobs(params: list[SamplingParams]) -> int | None:
    """How many most likely tokens a batch reports per step: the most any of its rows asks for (None: none asks)."""
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return max(asked) if asked else None


def packed_width(top: int | None) -> int:
    """Values per row of the sampler's packed result, known on every rank before the head's rank samples: the
    token, then (with log-probabilities) the chosen one's and the top-N's as float32 bits, and the top-N's ids."""
    return 1 if top is None else 2 + 2 * top


def logprob_bits(logp_BV: torch.Tensor, chosen_B: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probability of its chosen id and its `top` best, as int64 holding float32 bits, and the best
    ids: the layout `unpack_logprobs` reads (bits, then ids), one integer tensor for one broadcast."""
    best = logp_BV.topk(top, dim=-1)
    bits = torch.cat([logp_BV.gather(1, chosen_B[:, None]), best.values], dim=1).view(torch.int32).long()
    return bits, best.indices


def unpack_logprobs(row: list[int], top: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the top-`top` (id, log-probability) from a packed row (no token)."""
    values = torch.tensor(row[:1 + top], dtype=torch.int64).to(torch.int32).view(torch.float32).tolist()
    ids = row[1 + top:1 + 2 * top]
    return values[0], list(zip(ids, values[1:], strict=True))
