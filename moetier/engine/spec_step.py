"""The runner's side of speculative decoding (docs/speculative.md): after the target's forward over
a step in which some sequences carry drafts, verify them; with method "mtp", run the MTP layer over
the step's rows and chain it to make the next step's drafts. Eager: these steps are never replayed
from a CUDA graph (the scheduler's side is speculation.py).

Verify, for the B sequences with drafts (K the most drafts, each sequence's rows padded by repeating
its last row):

    logits [B, K + 1, V]   the target at the sequence's last token and its drafts
    greedy rows            spec/verify.greedy_accept (every row greedy), else rejection_accept with
                           greedy rows as one-hot distributions (exact: a one-hot keeps its argmax only)
    sampled rows           p = softmax(top-k / top-p filtered logits / temperature), the sampler's own
                           distribution; an MTP draft of a sampled request was drawn from q, the same
                           sampler's distribution over the MTP layer's logits, and is kept with
                           probability min(1, p(x) / q(x)) (q: the drafter's, kept from the step before);
                           an n-gram draft is deterministic and kept with probability p(x); the random
                           numbers are hashes of the request's seed and output index
                           (layers/sampler.uniform_noise), never of the batch

MTP drafting, per sequence of the step (models/mtp.py: the row of position i pairs token i + 1 with
the target's hidden state h_i): the catch-up pass runs the MTP layer over the positions whose KV the
step made valid (a prefill chunk's tokens, a decode token, or a verified token and its kept drafts),
each with the token after it (the next prompt token, the sampled token, the kept tokens); its last
row gives draft 1, and draft j > 1 runs the layer again one position on, on (draft j - 1, the
previous h'). A greedy request's draft is the argmax; a sampled request's is drawn from q (above),
its noise a hash of the request's seed and the draft's output index salted apart from the verify's,
and q [drafts, V] float32 is kept until the next step's verify (MtpDrafter.q: the last step's
only, so a request's drafts are verified in the step right after they were made: Request.draft_step).
Rows written past the kept tokens are rewritten by the next catch-up before any read. The chain uses
the first MTP layer at every depth (the catch-up keeps only its KV rows) and stops at the sequence's
last reserved page. Both host reads (the verified tokens, then the drafts) are between the model's
passes: these eager steps synchronise twice.
"""

from __future__ import annotations

import torch

from moetier.engine.step import SeqStep, TokenLogprob
from moetier.errors import MoetierError
from moetier.layers.attention import AttnBatch, make_batch
from moetier.layers.sampler import filter_top_k_top_p, mode_of, token_logprobs, uniform_noise
from moetier.spec.verify import PAD, greedy_accept, rejection_accept, sample_from

ACCEPT_SALT = 0x5DEECE66D  # the accept tests' noise differs from the last token's (same seed and index)
DRAFT_SALT = 0x2545F4914F6CDD1D  # a sampled draft's noise differs from both


def verify_index(seqs: list[tuple[int, SeqStep]], query_start: list[int], k: int, device) -> torch.Tensor:
    """[B, K + 1] rows of the step's hidden states: sequence b's last own token and its drafts (its
    draft's rows, the last repeated past its own length)."""
    rows = [[query_start[i] + min(j, s.num_draft) for j in range(k + 1)] for i, s in seqs]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def tempered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, K + 1, V] float32, temperature [B] float32 (0: greedy), top_k [B] int64 and top_p [B]
    float32 (None: no filter) -> the distributions the sampler draws from at each position: one-hot
    argmax for greedy rows, softmax of the filtered, tempered logits for the others. Graph-safe."""
    b, k1, v = logits.shape
    hot = temperature > 0
    flat = logits.reshape(b * k1, v) / torch.where(hot, temperature, torch.ones_like(temperature)).repeat_interleave(k1)[:, None]
    if top_k is not None:
        flat = filter_top_k_top_p(flat, top_k.repeat_interleave(k1), top_p.repeat_interleave(k1))
    probs = torch.softmax(flat, dim=-1).reshape(b, k1, v)
    onehot = torch.zeros_like(probs).scatter_(2, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(hot[:, None, None], probs, onehot)


def target_probs(logits: torch.Tensor, seqs: list[tuple[int, SeqStep]]) -> torch.Tensor:
    """tempered_probs with the sequences' own sampling parameters."""
    temp, top_k, top_p = _params(seqs, logits.device)
    filters = any(s.params.filters for _, s in seqs)
    return tempered_probs(logits, temp, top_k if filters else None, top_p if filters else None)


def _params(seqs: list[tuple[int, SeqStep]], dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    params = [s.params for _, s in seqs]
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev))


def verdict(logits: torch.Tensor, draft: torch.Tensor, lens: torch.Tensor, temperature: torch.Tensor,
            top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, mode: str,
            q: torch.Tensor | None = None) -> torch.Tensor:
    """The verify arithmetic of B sequences, in fixed shapes and without a host read (the eager step
    and the verify graphs, engine/verify_graphs.py, run this one function): logits [B, K + 1, V]
    float32, draft [B, K] and lens [B] int64, the sampling parameters [B], mode as
    layers/sampler.mode_of picks it (greedy: every row greedy; filter: some row filters), q [B, K, V]
    the drafts' distributions (None: deterministic drafts) -> [B, 1 + K + 1] int64: the drafts kept,
    then the emitted tokens (spec/verify.py, PAD past them)."""
    if mode == "greedy":
        accepted, tokens = greedy_accept(draft, lens, logits)
    else:
        u = uniform_noise(seeds ^ ACCEPT_SALT, steps, draft.shape[1])
        e = -torch.log(uniform_noise(seeds, steps, logits.shape[-1]))
        filters = mode == "filter"
        p = tempered_probs(logits, temperature, top_k if filters else None, top_p if filters else None)
        accepted, tokens = rejection_accept(draft, lens, p, q, uniforms=u, exponentials=e)
    return torch.cat([accepted[:, None], tokens], dim=1)


def draft_probs(draft: torch.Tensor, seqs: list[tuple[int, SeqStep]], draft_q: dict | None, vocab: int
                ) -> torch.Tensor | None:
    """[B, K, V] the distributions the drafts were drawn from: a sampled request's q where the drafter
    kept one for exactly these drafts (MtpDrafter.q), one-hot (a deterministic draft) elsewhere; None
    when no row has a q (rejection_accept's deterministic case)."""
    kept = [(draft_q or {}).get(s.request_id) for _, s in seqs]
    use = [q is not None and s.params.temperature > 0 and q[0][:s.num_draft] == s.token_ids[1:]
           for q, (_, s) in zip(kept, seqs)]
    if not any(use):
        return None
    b, k = draft.shape
    out = torch.zeros(b, k, vocab, dtype=torch.float32, device=draft.device)
    out.scatter_(2, draft.clamp_min(0)[:, :, None], 1.0)
    for i, (q, ok, (_, s)) in enumerate(zip(kept, use, seqs)):
        if ok:
            out[i, :s.num_draft] = q[1][:s.num_draft]
    return out


def verify(model, hidden: torch.Tensor, query_start: list[int], seqs: list[tuple[int, SeqStep]],
           draft_q: dict | None = None) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprob]]]:
    """seqs: (index in the step, record) of the sequences with drafts; draft_q: the MTP drafter's kept
    distributions (MtpDrafter.q; None: every draft deterministic) -> (request id -> the kept drafts
    and one more token; request id -> each of those tokens' logprob and alternatives, for the requests
    that asked: from the raw logits at its position, as the sampler's step reports them). One host read."""
    dev = hidden.device
    k = max(s.num_draft for _, s in seqs)
    idx = verify_index(seqs, query_start, k, dev)
    b = len(seqs)
    logits = model.logits(hidden[idx.reshape(-1)]).reshape(b, k + 1, -1)
    draft = torch.tensor([s.token_ids[1:] + [PAD] * (k - s.num_draft) for _, s in seqs], dtype=torch.int64,
                         device=dev)
    lens = torch.tensor([s.num_draft for _, s in seqs], dtype=torch.int64, device=dev)
    temp, top_k, top_p = _params(seqs, dev)
    seeds = torch.tensor([s.seed for _, s in seqs], dtype=torch.int64, device=dev)
    steps = torch.tensor([s.sample_index for _, s in seqs], dtype=torch.int64, device=dev)
    mode = mode_of([s.params for _, s in seqs])
    q = draft_probs(draft, seqs, draft_q, logits.shape[-1]) if mode != "greedy" else None
    out = verdict(logits, draft, lens, temp, top_k, top_p, seeds, steps, mode, q)
    accepted, tokens = out[:, 0], out[:, 1:]
    n = max(s.params.logprobs or 0 for _, s in seqs)
    asked = any(s.params.logprobs is not None for _, s in seqs)
    parts = [accepted[:, None].double(), tokens.double()]
    if asked:  # every verified position's logprobs ride along with the tokens (one read)
        chosen, top, top_ids = token_logprobs(logits.reshape(b * (k + 1), -1), tokens.clamp_min(0).reshape(-1), n)
        parts += [chosen.reshape(b, -1).double(), top.reshape(b, -1).double(), top_ids.reshape(b, -1).double()]
    host = torch.cat(parts, dim=1).tolist()
    emitted, logprobs = {}, {}
    for (_, s), row in zip(seqs, host):
        a = int(row[0])
        emitted[s.request_id] = [int(t) for t in row[1:a + 2]]
        if s.params.logprobs is not None:
            at, m = 2 + k, s.params.logprobs  # after accepted and the K + 1 tokens
            lp, top, ids = row[at:at + k + 1], row[at + k + 1:at + (k + 1) * (1 + n)], row[at + (k + 1) * (1 + n):]
            logprobs[s.request_id] = [(lp[j], [(int(ids[j * n + i]), top[j * n + i]) for i in range(m)])
                                      for j in range(a + 1)]
    return emitted, logprobs


class MtpDrafter:
    """The MTP layer's passes of one step: the catch-up over the rows the step made valid, then the
    chained drafts for the sequences that speculate next step."""

    def __init__(self, model, kv, page_size: int):
        if not getattr(model.cfg, "mtp_layers", 0):
            raise MoetierError("speculative method mtp: this model was built without its MTP layers (load it with "
                               "mtp=True, or give the engine the checkpoint directory)")
        self.model, self.kv, self.page_size = model, kv, page_size
        # the last run's sampled drafts: request id -> (its drafts, q [drafts, V] float32 they were drawn
        # from), for the next step's verify; replaced every run, so it holds one step's requests at most
        self.q: dict[str, tuple[list[int], torch.Tensor]] = {}

    @torch.inference_mode()
    def run(self, seqs: list[SeqStep], hidden: torch.Tensor, batch: AttnBatch, sampled: dict[str, int],
            emitted: dict[str, list[int]]) -> dict[str, list[int]]:
        """-> request id -> up to draft_next drafts (sequences that sample and speculate next)."""
        dev = hidden.device
        qs = batch.query_start_host
        ids, rows, parts, ends = [], [], [], []
        for i, s in enumerate(seqs):
            own = s.num_tokens - s.num_draft
            if not s.sample:
                after = s.token_ids[1:own] + [s.next_token]
            elif s.num_draft:
                after = emitted[s.request_id]  # the kept drafts and the token after them
            else:
                after = s.token_ids[1:own] + [sampled[s.request_id]]
            ids += after
            rows += range(qs[i], qs[i] + len(after))
            parts.append((s.start, len(after), s.pages))
            ends.append(len(ids) - 1)
        dev_rows = torch.tensor(rows, dtype=torch.int64, device=dev)
        # chains: (record, position of its last caught-up row, its row in the catch-up, drafts to make,
        # the output index of its first draft)
        chains = []
        for (i, s), end in zip(enumerate(seqs), ends):
            if s.sample and s.draft_next:
                last = parts[i][0] + parts[i][1] - 1
                room = len(s.pages) * self.page_size - 1 - last  # positions the chain may write
                first = s.sample_index + (len(emitted[s.request_id]) if s.num_draft else 1)
                chains.append((s, last, end, min(s.draft_next, 1 + room), first))
        at = torch.tensor([c[2] for c in chains], dtype=torch.int64, device=dev)
        logits, h = self.model.draft(torch.tensor(ids, dtype=torch.int64, device=dev), hidden[dev_rows],
                                     make_batch(parts, self.page_size, dev), self.kv, rows=at)
        self.q = {}
        if not chains:
            return {}
        live = list(range(len(chains)))
        probs = []  # per depth: (the chains drafting there, q [len(live), V] or None when all greedy)
        out = [self._pick(logits, chains, live, 0, probs)]
        for j in range(1, max(c[3] for c in chains)):
            live = [c for c in live if chains[c][3] > j]
            pick = torch.tensor(live, dtype=torch.int64, device=dev)
            step = make_batch([(chains[c][1] + j, 1, chains[c][0].pages) for c in live], self.page_size, dev)
            lg, hh = self.model.draft(out[-1][pick], h[pick], step, self.kv)
            nxt = torch.full((len(chains),), PAD, dtype=torch.int64, device=dev)
            h = h.clone()
            nxt[pick], h[pick] = self._pick(lg, chains, live, j, probs), hh
            out.append(nxt)
        host = torch.stack(out, dim=1).tolist()
        drafts = {c[0].request_id: row[:c[3]] for c, row in zip(chains, host)}
        for c, (s, *_) in enumerate(chains):
            if s.params.temperature > 0:
                rows = [q[at.index(c)] for at, q in probs if q is not None and c in at]
                self.q[s.request_id] = (drafts[s.request_id], torch.stack(rows))
        return drafts

    @staticmethod
    def _pick(logits: torch.Tensor, chains: list, live: list[int], depth: int, probs: list) -> torch.Tensor:
        """Drafts [len(live)] for the chains `live` at `depth` from the MTP logits [len(live), V]: the
        argmax for greedy requests, a draw from q for sampled ones (q appended to probs)."""
        recs = [(i, chains[c][0]) for i, c in enumerate(live)]
        if all(s.params.temperature == 0 for _, s in recs):
            probs.append((live, None))
            return logits.argmax(dim=-1)
        q = target_probs(logits.float()[:, None], recs)[:, 0]  # greedy rows one-hot: their argmax
        dev = logits.device
        seeds = torch.tensor([s.seed for _, s in recs], dtype=torch.int64, device=dev) ^ DRAFT_SALT
        steps = torch.tensor([chains[c][4] + depth for c in live], dtype=torch.int64, device=dev)
        probs.append((live, q))
        return sample_from(q, -torch.log(uniform_noise(seeds, steps, q.shape[-1])))
