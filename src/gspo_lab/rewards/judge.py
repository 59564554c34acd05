"""An LLM judge: a causal LM grades each (prompt, completion) with a rubric, as a reward function with TRL's contract.

    reward=judge reward.functions.0.path=/path/to/judge            # a save_pretrained causal LM and its tokenizer

The rubric is a text with `{prompt}` and `{completion}` in it, rendered through the judge's chat template when its
tokenizer has one (one user message), else as it is. The score comes from one of two places (`mode`):

- `logprob` (the default): no text is generated; the judge's next-token distribution after the rubric gives
  P(yes) / (P(yes) + P(no)) over the first token of each verdict in `verdicts` (its keys: the "yes" word first,
  then the "no" word), a score in [0, 1] that cannot fail to parse;
- `output`: the judge answers greedily (up to `max_new_tokens`), and its answer is read strictly: the verdict
  words of `verdicts` (each maps to its score), or, with no verdicts, one number in [`low`, `high`]. An answer that
  is neither is a grading failure: the completion gets None (no reward: it takes no part in its group's baseline,
  and its advantage is 0), and the judge counts it in `failures`, logged as reward/<name>/parse_failures. Never a
  silent 0.

Both score once per round (`batched`). `backend` serves the judge:

- `hf`: transformers in the training process, in batches of `batch_size` under inference mode, on `device` (null:
  the GPU where there is one), the model going back to the host between calls under `offload`;
- `vllm`: a vLLM engine of its own in a process of its own (gspo_lab.rewards.judge_engine), with the `vllm`
  settings of rollout.vllm (its KV cache, its share of the GPU); started at the first call. The config's default
  is the run's rollout.backend.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from gspo_lab.grading.answers import text_of
from gspo_lab.rewards.reward_model import DTYPES

NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*\.?\s*$")  # the whole answer is one number
RUBRIC = ("Question: {prompt}\nAnswer: {completion}\nIs the answer correct? Reply yes or no.\nVerdict:")
FIELDS = re.compile(r"\{(prompt|completion)\}")


def fill(rubric: str, prompt: str, completion: str) -> str:
    """The rubric with `{prompt}` and `{completion}` filled in, in one pass: any other brace is text (a rubric that
    asks for JSON), and braces in the prompt or the completion are never read as fields.

    >>> fill('Q: {prompt} A: {completion} Reply as {"verdict": "yes"}', "1+1=", "{prompt}")
    'Q: 1+1= A: {prompt} Reply as {"verdict": "yes"}'
    """
    values = {"prompt": prompt, "completion": completion}
    return FIELDS.sub(lambda match: values[match.group(1)], rubric)


class Judge:
    """A reward function backed by a causal LM that grades with `rubric` (`__call__`: TRL's contract)."""

    batched = True

    def __init__(self, path: str, rubric: str = RUBRIC, mode: str = "logprob",
                 verdicts: dict[str, float] | None = None, low: float = 0.0, high: float = 10.0,
                 max_new_tokens: int = 8, batch_size: int = 16, dtype: str = "float32", device: str | None = None,
                 offload: bool = False, backend: str = "hf", vllm: dict | None = None,
                 chat_template_kwargs: dict | None = None, engine_timeout_s: float = 600.0,
                 key: str = "reward.functions.<i>") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        verdicts = {" yes": 1.0, " no": 0.0} if verdicts is None and mode == "logprob" else dict(verdicts or {})
        if mode not in ("logprob", "output"):
            raise ValueError(f"{key}.mode={mode!r} is invalid: must be logprob or output")
        if "{prompt}" not in rubric or "{completion}" not in rubric:
            raise ValueError(f"{key}.rubric={rubric!r} is invalid: it must hold {{prompt}} and {{completion}}")
        if mode == "logprob" and len(verdicts) != 2:
            raise ValueError(f"{key}.verdicts={verdicts!r} is invalid: mode=logprob compares two verdicts, the "
                             "'yes' word first")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{key}.batch_size={batch_size!r} is invalid: must be an integer >= 1")
        if dtype not in DTYPES:
            raise ValueError(f"{key}.dtype={dtype!r} is invalid: must be one of {list(DTYPES)}")
        if backend not in ("hf", "vllm"):
            raise ValueError(f"{key}.backend={backend!r} is invalid: must be hf or vllm")
        if not (isinstance(engine_timeout_s, (int, float)) and engine_timeout_s > 0):
            raise ValueError(f"{key}.engine_timeout_s={engine_timeout_s!r} is invalid: must be a number > 0")
        if backend == "vllm" and offload:
            raise ValueError(f"{key}.offload=true with {key}.backend=vllm: the judge's engine holds its own memory "
                             f"(set its share with {key}.vllm.gpu_memory_utilization); offload is for hf")
        self.rubric, self.mode, self.verdicts, self.low, self.high = rubric, mode, verdicts, low, high
        self.max_new_tokens, self.batch_size, self.offload, self.key = max_new_tokens, batch_size, offload, key
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # enable_thinking=false for a Qwen3 judge
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = str(Path(str(path)).expanduser())  # a folder under ~; a hub id stays as it is
        self.__name__ = Path(path).name or path
        self.model, self.engine = None, None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            if backend == "hf":
                self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
            else:
                AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise ValueError(f"{key}.path={path!r}: no causal LM there (a save_pretrained folder with its "
                             f"tokenizer, or a hub id in the local cache): {error}") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if backend == "vllm":
            self.engine = judge_engine(path, dtype, vllm, self.device, key, engine_timeout_s)
        else:
            self.model.requires_grad_(False)
            self.model.to("cpu" if offload else self.device)
        self.verdict_ids = [self.first_token(word) for word in verdicts] if mode == "logprob" else []
        if mode == "logprob" and len(set(self.verdict_ids)) != 2:
            raise ValueError(f"{key}.verdicts={verdicts!r}: both start with the same token "
                             f"({self.verdict_ids[0]}), so their odds cannot be told apart; pick other words")
        if mode == "logprob":
            self.check_verdicts()
        self.failures = 0  # answers that were neither a verdict nor a number in range (mode=output)

    def check_verdicts(self) -> None:
        """Refuse verdicts whose first token is not the first token of the same reply after the judge's chat
        template: a chat judge answers "Yes" (no space), or "<think>" first where thinking is on, and the odds of
        " yes" there say nothing."""
        if not getattr(self.tokenizer, "chat_template", None):
            return
        asked = [{"role": "user", "content": fill(self.rubric, "1+1=", "2")}]
        opening = self.tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=True,
                                                     **self.chat_template_kwargs)
        for word, token in zip(self.verdicts, self.verdict_ids):
            whole = self.tokenizer.apply_chat_template(asked + [{"role": "assistant", "content": word.strip()}],
                                                       tokenize=False, **self.chat_template_kwargs)
            reply = whole[len(opening):] if whole.startswith(opening) else None
            first = None if not reply else self.tokenizer(reply, add_special_tokens=False)["input_ids"][0]
            if first != token:
                seen = "cannot be told" if first is None else repr(self.tokenizer.convert_ids_to_tokens(first))
                raise ValueError(
                    f"{self.key}.verdicts={self.verdicts!r}: after the judge's chat template the reply "
                    f"{word.strip()!r} starts with token {seen}, not {word!r}'s "
                    f"{self.tokenizer.convert_ids_to_tokens(token)!r}, so the verdict odds would be read at the wrong "
                    "token; give the verdicts as a reply starts them (e.g. {'Yes': 1.0, 'No': 0.0}), and where the "
                    f"template opens a reply with <think>, set {self.key}.chat_template_kwargs.enable_thinking=false")

    def first_token(self, word: str) -> int:
        ids = self.tokenizer(word, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"{self.key}.verdicts: {word!r} tokenizes to nothing")
        return ids[0]

    def grading_prompt(self, prompt, completion) -> str:
        """The rubric filled in, through the judge's chat template where it has one."""
        text = fill(self.rubric, text_of(prompt) if isinstance(prompt, list) else prompt, text_of(completion))
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True, **self.chat_template_kwargs)
        return text

    def parse(self, answer: str) -> float | None:
        """An answer's score, strictly: a verdict word (the whole answer, stripped, case-insensitive), or with no
        verdicts one number in [low, high]; None where it is neither.

        >>> judge = Judge.__new__(Judge)
        >>> judge.verdicts, judge.low, judge.high = {"yes": 1.0, "no": 0.0}, 0, 10
        >>> judge.parse(" Yes "), judge.parse("no."), judge.parse("yes, mostly")
        (1.0, 0.0, None)
        >>> judge.verdicts = {}
        >>> judge.parse("7"), judge.parse("7.5."), judge.parse("11"), judge.parse("about 7")
        (7.0, 7.5, None, None)
        """
        answer = answer.strip()
        if self.verdicts:
            words = {word.strip().lower(): score for word, score in self.verdicts.items()}
            return words.get(answer.lower().rstrip("."))
        match = NUMBER.match(answer)
        value = float(match.group(1)) if match else None
        return value if value is not None and self.low <= value <= self.high else None

    @torch.inference_mode()
    def __call__(self, prompts, completions, **kwargs) -> list[float | None]:
        """Each completion's grade, in batches of `batch_size` (hf) or all at once (vllm)."""
        texts = [self.grading_prompt(p, c) for p, c in zip(prompts, completions)]
        if self.engine is not None:
            return self.served(texts)
        self.model.to(self.device)
        grades = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                    padding_side="left", add_special_tokens=False).to(self.device)
            grades += self.verdict_odds(inputs) if self.mode == "logprob" else self.answers(inputs)
        if self.offload:
            self.model.to("cpu")
        return grades

    def served(self, texts: list[str]) -> list[float | None]:
        """The grades from the judge's vLLM engine: the same odds, or the same strictly parsed answers."""
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        if self.mode == "logprob":
            pairs = torch.tensor(self.engine.verdict_logprobs(ids, self.verdict_ids))  # [n, 2]
            return pairs.log_softmax(-1)[:, 0].exp().tolist()
        answers = self.engine.answers(ids, self.max_new_tokens, [self.tokenizer.eos_token_id])
        return self.parsed(self.tokenizer.batch_decode(answers, skip_special_tokens=True))

    def verdict_odds(self, inputs) -> list[float]:
        """P(yes) / (P(yes) + P(no)) of the next token after each (left-padded) grading prompt."""
        positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding: each row from 0
        logits = self.model(**inputs, position_ids=positions).logits[:, -1].float()  # [b, V]
        pair = logits[:, self.verdict_ids].log_softmax(-1)  # [b, 2]: renormalised over the two verdicts
        return pair[:, 0].exp().tolist()

    def answers(self, inputs) -> list[float | None]:
        """The judge's greedy answers, parsed; each unparsable one counted."""
        out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                  pad_token_id=self.tokenizer.pad_token_id)
        return self.parsed(self.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                                       skip_special_tokens=True))

    def parsed(self, answers: list[str]) -> list[float | None]:
        """Each answer's grade (`parse`), the unparsable ones counted."""
        grades = [self.parse(answer) for answer in answers]
        self.failures += sum(grade is None for grade in grades)
        return grades

    def metrics(self) -> dict[str, float]:
        """What WeightedRewards logs beside the function's rewards: its running count of unparsable answers."""
        return {"parse_failures": float(self.failures)}

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps: the running count of unparsable answers."""
        return {"failures": self.failures}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.failures = int(state.get("failures", 0))

    def close(self) -> None:
        """Stop the judge's vLLM engine, where it has one."""
        if self.engine is not None:
            self.engine.close()


def judge_engine(path: str, dtype: str, settings: dict | None, device: torch.device, key: str,
                 timeout_s: float = 600.0):
    """The judge's vLLM engine (not started yet), its settings checked as rollout.vllm's are, named by `key`."""
    from gspo_lab.engine_settings import VLLMConfig
    from gspo_lab.rewards.judge_engine import JudgeEngine
    from gspo_lab.rollout.vllm.setup import available

    if not available():
        raise ValueError(f"{key}.backend=vllm needs vLLM installed (pip install -e '.[vllm]' on a GPU node, "
                         "make test-vllm's .venv-vllm on CPU); or backend=hf")
    settings = dict(settings or {})
    known = [name for name in VLLMConfig.__dataclass_fields__ if name != "dtype"]  # the judge's own dtype rules
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"{key}.vllm.{unknown[0]} is not a setting of the judge's engine (those of rollout.vllm but "
                         f"dtype, which is {key}.dtype: {', '.join(known)})")
    try:
        config = VLLMConfig(**settings)
    except ValueError as error:
        raise ValueError(str(error).replace("rollout.vllm", f"{key}.vllm")) from None
    return JudgeEngine(path, dtype, config, device.type, key, timeout_s)
