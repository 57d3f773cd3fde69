"""The embedded CPU demo's curriculum (`megatron-search demo`, demo/pipeline.py).

The stages themselves are configured by the usual sections (`sft`, `optim`, `rm`, `grpo`, ...);
this section holds what only the demo decides: its world's phrasing and answer style, the practice
worlds and drills it writes, the two warm-up stages that run before the agent SFT (copying, then
reading), the SFT mix and GRPO's learning rate. Ours, sized by measurement
for a model trained from scratch on 2 CPU cores (README, "The embedded demo").
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from .base import Section

# The demo's SFT files, by the keys the mixes use.
PARTS = ("tool", "practice", "copy", "copy_varied", "read", "short")
# How an agent trajectory goes about a question (data/demo_tasks.one_hop_sft_examples): search the subject and
# answer from the results; answer at once (a guess: every entity is invented); search with a query that misses
# the subject (results without the answer, then a guess); search the subject twice (right, one call too many).
STRATEGIES = ("search", "no_search", "miss", "redundant")


class DemoConfig(Section):
    world_phrasing: Literal["any", "first"] = Field(
        "first", description="the demo world's documents (and the reading drills) state a fact with any template of "
        "its relation or the first, subject-first one only (data/world.build_world)")
    world_layout: Literal["profiles", "facts"] = Field(
        "facts", description="the demo world's documents (data/world.build_world): a profile page per entity "
        "and site stating several of its facts, which the trajectories search by the subject's name, or a page "
        "per fact stating it alone, which they search by the fact's sentence up to its object ('X was born in', "
        "data/demo_tasks.fact_query): the top result (search.max_results 1 in configs/demo.yaml) is then that "
        "sentence, the answer right after the query's words, so reading it is copying one name, not finding one "
        "fact among several, which a model trained from scratch learnt only abruptly or not at all (README)")
    answer_style: Literal["name", "sentence"] = Field(
        "sentence", description="trajectories and reading drills answer with the bare name or restate the fact "
        "('X was written by Y.', data/demo_tasks.fact_sentence)")
    name_words: NonNegativeInt = Field(
        1024, description="0: names are made of freshly invented syllable words, several BPE tokens each. N: every "
        "invented word (of the demo world, the practice worlds and the drills) is drawn from a pool of N words, and "
        "each pool word is one token of the demo tokenizer (counted in the model's vocabulary), so copying a name "
        "is copying 1-3 whole tokens (data/world.word_pool). Seed 1 with 1024 (measured): the copy warm-up "
        "reached 90% at step 400 instead of 600 on syllable names")
    practice_worlds: NonNegativeInt = Field(
        30, description="extra invented worlds whose single-hop trajectories are the 'practice' SFT part "
        "(~365 each)")
    reading_worlds: NonNegativeInt = Field(
        40, description="extra invented worlds whose one-search trajectories, without the system prompt, are "
        "the reading warm-up's 'short' part (data/demo_tasks.short_trajectories; ~410 each, so 40 give one fresh "
        "fact per row up to the warm-up's cap of 1,000 x 16 rows). Fresh facts make the warm-up learn to copy "
        "the answer out of the result rather than recall it: after 1,000 steps on the 30 practice worlds' "
        "~3,100 one-search trajectories (seed 2, measured), teacher-forced answers were exact for 44/64 trained "
        "facts and 14/64 facts of an unseen world")
    tokenizer_practice_sample: PositiveInt = Field(
        2000, description="practice trajectories among the demo tokenizer's training texts (they repeat the tool "
        "schema and sentence templates; all of them would only slow the BPE training)")
    copy_drills: PositiveInt = Field(
        20000, description="copy drills written per layout: 'copy' ('Repeat exactly: <invented name>') and "
        "'copy_varied' (the name among filler words and a distractor name; data/demo_tasks.copy_drills)")
    reading_drills: PositiveInt = Field(5000, description="passage + question -> answer examples written ('read')")
    warmup_steps: NonNegativeInt = Field(
        800, description="cap on the copy warm-up's SFT steps on the 'copy' drills before the agent SFT (0: no "
        "warm-up); it ends earlier once warmup_threshold is reached. Copying fresh names: 17% after 300 steps, 77% "
        "after 400, 97% after 500 (measured), but from a fixed offset before the end of the prompt (0% once anything "
        "follows the name)")
    warmup_threshold: float = Field(
        0.9, gt=0, le=1, description="copy warm-up: share of held-out copy drills (fresh names) copied exactly, "
        "greedily, that ends it (sft.skill_check, every skill_check_every steps)")
    warmup_lr: PositiveFloat = Field(2e-3, description="constant LR of the warm-up (after optim.warmup_steps)")
    warmup_batch: PositiveInt = Field(128, description="drills per warm-up step (one per row, unpacked)")
    warmup_seq_length: PositiveInt = Field(
        40, description="row length of the warm-up (a copy drill is 19-33 tokens with the demo tokenizer)")
    reading_warmup_steps: NonNegativeInt = Field(
        1000, description="cap on the reading warm-up's SFT steps after the copy warm-up, on reading_warmup_mix "
        "(0: none); it ends earlier once reading_threshold is reached. On the 'short' trajectories its held-out "
        "check reached 98.4% at step 800 and 90.6% at step 900 for seeds 1 and 2, and stood at 84.4% at the cap "
        "for seed 3 (measured, README). On the multi-fact reading drills ('read') the "
        "skill appeared late and abruptly (0% after 800 steps, 45% after 1,600 in one run, 1.6% after 3,000 in "
        "another), at a step that varied from run to run and machine to machine")
    reading_threshold: float = Field(
        0.9, gt=0, le=1, description="reading warm-up: share of held-out checks answered exactly, greedily, that "
        "ends it: the answers of short trajectories from an unseen practice world when the mix has 'short', else "
        "reading drills")
    skill_check_every: PositiveInt = Field(100, description="warm-up steps between skill checks")
    skill_check_drills: PositiveInt = Field(64, description="held-out drills (fresh names) per skill check")
    reading_warmup_mix: dict[str, float] = Field(
        default_factory=lambda: {"short": 1.0},
        description="sampling weights of the reading warm-up (keys as sft_mix; 'short': one-search trajectories "
        "of the reading_worlds, without the system prompt, data/demo_tasks.short_trajectories)")
    reading_warmup_lr: PositiveFloat = Field(2e-3, description="constant LR of the reading warm-up")
    reading_warmup_batch: PositiveInt = Field(16, description="examples per reading warm-up step (one per row)")
    reading_warmup_seq_length: PositiveInt = Field(
        256, description="row length of the reading warm-up (a short trajectory is 70-244 tokens with the demo "
        "tokenizer, a reading drill ~110)")
    sft_lr: PositiveFloat = Field(
        1e-3, description="peak LR of the agent SFT after the warm-ups (2e-3 erased the copy warm-up's copying "
        "in an earlier curriculum, measured)")
    sft_min_lr: PositiveFloat = Field(1e-4, description="final LR of the agent SFT's cosine schedule")
    sft_mix: dict[str, float] = Field(
        default_factory=lambda: {"tool": 0.2, "practice": 0.7, "copy_varied": 0.1},
        description=f"agent SFT sampling weights over {', '.join(PARTS)} ('tool': the demo world's trajectories)")
    strategy_mix: dict[str, float] = Field(
        default_factory=lambda: {"search": 0.25, "no_search": 0.15, "miss": 0.3, "redundant": 0.3},
        description=f"share of the agent trajectories ('tool' and 'practice') following each strategy "
        f"({', '.join(STRATEGIES)}; issue 21: GRPO's reward selects among them, as it would among trajectories "
        "from several sources). 1.15 calls per trajectory on average: more than the 1 of always searching "
        "once, so GRPO's selection must not raise the calls")
    rl_questions: float = Field(
        0.5, ge=0, lt=1, description="share of the demo world's training subjects whose questions are kept out of "
        "the agent SFT and are GRPO's prompts instead (0: GRPO samples the same training questions the SFT "
        "trajectories answered, whose answers the policy may recall instead of searching). Split by subject: "
        "a search for a subject may show all its facts, so no SFT trajectory reads an RL question's answer. "
        "Seed 1, profile world with the word pool, 0.5: GRPO - SFT +7.5 points (SE 2.8) against +1.6 (SE 3.2) "
        "without (measured)")
    grpo_lr: PositiveFloat = Field(
        3e-4, description="constant GRPO learning rate (no warm-up). From one SFT checkpoint (seed 1), held-out GRPO - "
        "SFT: +2.7 points (SE 1.9) at 1e-4, +6.3 (SE 2.3) at 3e-4, -1.6 (SE 2.0) at 6e-4, where broken tool calls "
        "doubled (measured on the profile world, session 13)")
    pass_k: PositiveInt = Field(8, description="samples per training question for the report's SFT pass@k (RL's "
                                "ceiling: GRPO can only sharpen what the policy does some of the time)")
    pass_k_questions: PositiveInt = Field(48, description="training questions sampled for the pass@k")

    @field_validator("sft_mix", "reading_warmup_mix")
    @classmethod
    def _known_parts(cls, mix: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(mix) - set(PARTS))
        if unknown or not any(w > 0 for w in mix.values()):
            raise ValueError(f"keys are {', '.join(PARTS)}, at least one with a positive weight")
        if any(w < 0 for w in mix.values()):
            raise ValueError("weights must be >= 0")
        return mix

    @field_validator("strategy_mix")
    @classmethod
    def _known_strategies(cls, mix: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(mix) - set(STRATEGIES))
        if unknown or any(w < 0 for w in mix.values()) or not (mix.get("search", 0) + mix.get("redundant", 0)) > 0:
            raise ValueError(f"keys are {', '.join(STRATEGIES)}, weights >= 0, and 'search' or 'redundant' positive "
                             f"(the strategies that answer right), got {mix}")
        return mix

    @model_validator(mode="after")
    def _parts_exist(self) -> "DemoConfig":
        if not self.sft_mix.get("tool"):
            raise ValueError("sft_mix needs a positive 'tool' weight (the demo world's own trajectories)")
        for name, mix in (("sft_mix", self.sft_mix), ("reading_warmup_mix", self.reading_warmup_mix)):
            if mix.get("practice", 0) > 0 and not self.practice_worlds:
                raise ValueError(f"{name} weighs 'practice' trajectories but practice_worlds is 0 (none are written)")
            if mix.get("short", 0) > 0 and not self.reading_worlds:
                raise ValueError(f"{name} weighs 'short' trajectories but reading_worlds is 0 (none are written)")
        return self
