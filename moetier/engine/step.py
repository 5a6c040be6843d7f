"""The two records between the scheduler and the model runner: what to run, and what came out.

Plain data only (ints, lists, SamplingParams): no Request objects, no tensors, no shared state, so a
worker in another process can receive the same record (multi-GPU) and tests can build one by hand.

    StepInput  [SeqStep]: per sequence its new tokens, where they start, its page table (and state
               slot, and state checkpoints to restore or save), and how to sample its next token when
               the chunk reaches its end; the host KV tier's page copies of the step
    StepOutput the token sampled for each request that sampled (and the logprobs asked for); with
               speculative decoding the tokens each verifying request kept, and the next drafts
    RankQuery  a control record of a parallel engine, sent between steps on the same channel as
               StepInput: every rank answers with its own data (RankQuery.answer)
    StepVerdict what rank 0's verify kept, sent to the workers inside a speculative step
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetier.errors import MoetierError
from moetier.sampling_params import SamplingParams


@dataclass
class SeqStep:
    request_id: str
    start: int  # tokens computed before this step: the position of token_ids[0]
    token_ids: list[int]  # the tokens this step computes
    pages: list[int]  # the sequence's page table; NOTE: read-only for the runner
    sample: bool  # the chunk reaches the end: sample the next token
    params: SamplingParams
    seed: int  # noise seed of the request's sampling
    sample_index: int  # index of the token sampled (its output length so far)
    state_slot: int = -1  # its slot of the recurrent-state pool (layers/state_cache.py); -1: no state
    num_cached: int = 0  # tokens of `start` a prefix-cache hit supplied (metrics and logs only)
    # models with recurrent state and prefix caching: the state checkpoint copied into state_slot before
    # the chunk (a hit resumes from it), and the one the slot's state is saved into after it; -1: none
    restore_checkpoint: int = -1
    save_checkpoint: int = -1
    # requests that asked for prompt logprobs: the prompt tokens this chunk's positions predict
    # (position start + i predicts prompt_targets[i]); shorter than token_ids by one where the chunk
    # holds the prompt's last token, whose logits sample the first output token instead
    prompt_targets: list[int] = field(default_factory=list)
    # speculative decoding (engine/spec_step.py): the last num_draft of token_ids are drafts to verify;
    # MTP drafting: the drafts to make for the next step, and the token after the chunk where it is
    # known (a prefill chunk that does not sample; -1 otherwise), which its MTP rows read
    num_draft: int = 0
    draft_next: int = 0
    next_token: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)
    # set by rank 0 of a parallel engine before the broadcast: whether its runner replays the decode
    # graph for this step; NOTE: workers follow it, so every rank replays or runs eagerly together
    replay: bool = False
    # the prefix cache's host tier (engine/kv_host_tier.CopyPlan), run before the step writes its KV:
    # first every (GPU page, host slot) copy to the host, then every (host slot, GPU page) copy back
    copies_to_host: list[tuple[int, int]] = field(default_factory=list)
    copies_to_gpu: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


# a sampled token's logprob and its alternatives [(token id, logprob)], most likely first
TokenLogprob = tuple[float, list[tuple[int, float]]]
# a prompt token's logprob, its rank in the distribution (1: the most likely) and the alternatives
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass
class StepOutput:
    sampled: dict[str, int]  # request id -> the token sampled for it this step
    # rows the step's forward ran for the requests (a replayed verify graph pads each sequence's drafts
    # to the step's most, engine/verify_graphs.py): what a replayed trace's cursor moved by
    num_tokens: int
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # requests that asked for them
    # request id -> (the position of the first token scored, one entry per scored prompt token)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    # speculative decoding: per request that verified drafts, the kept drafts and one more token (its
    # `sampled` entry is the last of them); per request, the MTP layer's drafts for its next step
    emitted: dict[str, list[int]] = field(default_factory=dict)
    emitted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # per emitted token
    drafts: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepVerdict:
    """Sent by rank 0 of a parallel engine inside a step, after it verified the step's drafts (its
    workers cannot: only rank 0 samples): each worker then rolls recurrent state back where a draft was
    rejected and runs the MTP passes over the kept tokens, in step with rank 0 (their collectives pair
    up). Sent exactly when ModelRunner.shares_verdict(step) holds, which every rank computes alike."""

    sampled: dict[str, int]  # StepOutput.sampled: request id -> the step's last token for it
    emitted: dict[str, list[int]]  # StepOutput.emitted: the kept drafts and one more token


# what a RankQuery may ask for -> how a rank's model answers it (plain data, picklable)
QUERIES = {
    # the expert backends' counters summed over this rank's MoE layers (models/base.CausalLM.expert_stats)
    "expert_stats": lambda model: model.expert_stats(),
}


@dataclass(frozen=True)
class RankQuery:
    """Sent by rank 0 of a parallel engine between steps, never inside one (LLM.metrics): each rank
    answers from its own model and rank 0 gathers the answers in rank order (dist/executor.py).
    NOTE: answers read device counters (a host sync), which is why a query never rides inside a step."""

    what: str

    def __post_init__(self):
        if self.what not in QUERIES:
            raise MoetierError(f"RankQuery({self.what!r}): choose one of {', '.join(QUERIES)}")

    def answer(self, model) -> dict:
        return QUERIES[self.what](model)
