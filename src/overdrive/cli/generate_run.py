"""`overdrive run` for a generation plan: JSONL (or one prompt per line) in, JSONL out in input order (text, token
ids, finish reason, token counts), the plan's generator under continuous batching, a bad record filed in
OUTPUT.errors.jsonl, resumable (a manifest of the input's digest and the plan; the output's finished indices)."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from overdrive.core.digest import file_sha256
from overdrive.core.errors import ConfigError, DataError, RunAborted, arg

PARAM_FIELDS = {"max_tokens": "max_new_tokens", "max_new_tokens": "max_new_tokens", "temperature": "temperature",
                "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop"}  # a record's fields


def _claim(manifest_path: Path, done: set[int], manifest: dict) -> None:
    """A fresh run writes what its completions depend on to MANIFEST; a resumed one (records `done`) must share it.

    Raises:
        ConfigError: a resume whose input, plan, default max tokens, text field or device type differ from the first
            run's, or whose first run left no manifest."""
    if not done:
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        return
    try:
        before = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{arg('resume')}: {manifest_path} is missing or unreadable, so the output cannot be told to "
                          f"come from this input and plan; pass {arg('overwrite')} to start again") from None
    changed = [key for key in manifest if before.get(key) != manifest[key]]
    if changed:
        raise ConfigError(f"{arg('resume')}: the output was written with another {', '.join(changed)} "
                          f"({manifest_path}); resuming would mix two runs' completions; pass {arg('overwrite')} to start again")


def run_main(args) -> int:
    """`overdrive run PLAN.json --input prompts.jsonl --output completions.jsonl` for a generation plan."""
    from overdrive.core import devices
    from overdrive.core.measure import compiled_graphs
    from overdrive.core.report import make_console
    from overdrive.generate.continuous import SchedulerStats
    from overdrive.generate.engine import SamplingParams
    from overdrive.generate.plan import SPECULATIVE, GenerationPlan, build_generator
    from overdrive.workloads.generation import create_generation_workload

    if args.workload is not None:  # the plan names its workload
        raise ConfigError(f"{args.workload}: not for a generation plan, which names its own workload: "
                          f"overdrive run {args.plan} --input ... --output ...")
    for name, unset in (("num_workers", None), ("weights", None)):
        if getattr(args, name) is not unset:
            raise ConfigError(f"{arg(name, getattr(args, name))}: not for a generation plan")
    if args.engine != "local":
        raise ConfigError(f"{arg('engine', args.engine)}: a generation plan runs on the local engine")
    plan = GenerationPlan.load(args.plan)
    source, output = Path(args.input), Path(args.output)
    if output.suffix != ".jsonl":
        raise ConfigError(f"{arg('output', str(output))}: a generation run writes JSONL (.jsonl)")
    if not source.is_file():
        raise ConfigError(f"{arg('input', str(source))}: no such file")
    records = list(_read_prompts(source, args.text_field or "prompt"))
    if not records:  # as `run` of any other plan: said before the model is built
        raise DataError(f"{arg('input', str(source))} holds no records (the file is empty or blank)")
    errors_path = output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")
    manifest_path = output.with_name(output.name.removesuffix(".jsonl") + ".manifest.json")
    done = set()
    if output.exists() or errors_path.exists():
        if args.resume:
            done = _indices(output) | _indices(errors_path)
        elif args.overwrite:
            for path in (output, errors_path, manifest_path):
                path.unlink(missing_ok=True)
        else:
            raise ConfigError(f"{output} exists; pass {arg('overwrite')} to replace it or {arg('resume')} to continue it")
    console = make_console()
    device = devices.resolve_device(args.device if args.device != "auto" else plan.device)
    _claim(manifest_path, done, {"input_sha256": file_sha256(source), "plan_sha256": file_sha256(args.plan),
                                 "max_new_tokens": args.max_new_tokens or plan.max_new_tokens,
                                 "text_field": args.text_field or "prompt", "device": device.type})
    batch = args.batch_size if isinstance(args.batch_size, int) else plan.batch_size
    setup_started = time.perf_counter()
    workload = create_generation_workload(plan.workload, log=lambda line: console.print(line, highlight=False))
    # Continuous batching keeps the batch full as answers of different lengths end; speculative decoding verifies
    # its drafts one sequence at a time, so a plan with it runs its prompts in turn.
    continuous = not set(SPECULATIVE) & set(plan.names)
    gen = build_generator(workload.model, workload.tokenizer, plan.steps, device=device, max_batch_size=batch,
                          continuous=continuous)
    if continuous:  # the batch shrinks as the last prompts end: padded to the warm-up's graph, not compiled again
        gen.pad_to_compiled = True
    gen.generate([workload.prompts[0]] * batch, SamplingParams(max_new_tokens=2))  # compiles, as serving would first
    if continuous:
        gen.stats = SchedulerStats()  # the figures printed at the end are the run's, not the warm-up's
    setup_s = time.perf_counter() - setup_started
    graphs_before = compiled_graphs()
    default = {"max_new_tokens": args.max_new_tokens or plan.max_new_tokens}
    eos = getattr(workload.tokenizer, "eos_token_id", None)
    if eos is not None:  # a completion ends at the end of its text, as Hugging Face's generate ends it
        default["stop_token_ids"] = (eos,)
    context = getattr(workload.model.config, "max_position_embeddings", None)
    started, failed = time.perf_counter(), 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a") as out, errors_path.open("a") as errors:
        writer = _InOrder(out)
        pending: list[tuple[int, list[int], SamplingParams, dict]] = []  # the static path's batch

        def flush() -> None:
            if pending:
                completions = gen.generate([p[1] for p in pending], [p[2] for p in pending])
                for (index, _, _, record), c in zip(pending, completions):
                    writer.add(index, record, c)
                pending.clear()
            writer.write_ready()

        def drain(keep: int) -> None:
            """Steps the continuous batcher until at most `keep` requests wait, writing what ends in input order."""
            while gen.has_unfinished and len(gen.waiting) > keep:
                for event in gen.step():
                    if event.finished is not None:
                        writer.finish(event.request_id, event.finished)
                writer.write_ready()

        for index, record in records:
            if index in done:
                continue
            try:
                text, params = _request(record, default, args.text_field or "prompt")
                ids = gen.encode(text)
                if context is not None and len(ids) + params.max_new_tokens > context:
                    raise ValueError(f"the prompt's {len(ids)} tokens + {params.max_new_tokens} new ones exceed the "
                                     f"model's context of {context}")
                if continuous:
                    writer.expect(gen.submit(ids, params), index, record)
            except (ValueError, TypeError) as exc:
                if not continuous:
                    flush()  # keep the output in input order
                errors.write(json.dumps({"index": index, "error": str(exc)}) + "\n")
                errors.flush()
                failed += 1
                if args.max_errors is not None and failed > args.max_errors:
                    if continuous:
                        drain(keep=-1)  # the records before it are answered and kept
                    raise RunAborted(f"{failed} records failed, more than {arg('max_errors', args.max_errors)} (the "
                                     f"reasons are in {errors_path}); the {writer.written} completions before them are "
                                     "kept")
                continue
            if continuous:
                drain(keep=batch)  # a bounded queue: submitting runs no further ahead than one batch
            else:
                pending.append((index, ids, params, record))
                if len(pending) == batch:
                    flush()
        if continuous:
            drain(keep=-1)
        flush()
    wall = time.perf_counter() - started
    if failed == 0 and errors_path.stat().st_size == 0:
        errors_path.unlink()
    written, tokens = writer.written, writer.tokens
    console.print(f"{written:,} of {len(records) - len(done):,} prompts → {output}; {failed:,} failed"
                  + (f" (see {errors_path})" if failed else "") + (f"; {len(done):,} done before the resume" if done else ""),
                  highlight=False)
    scheduling = (f"continuous batching of up to {batch} sequence{'s' if batch > 1 else ''}"
                  + (f" (KV blocks {gen.stats.kv_waste:.1%} empty, {gen.stats.preemptions} preempted)" if tokens else "")
                  if continuous else f"one prompt at a time ({next(n for n in SPECULATIVE if n in plan.names)})")
    console.print(f"{tokens:,} new tokens in {wall:.3g} s = {tokens / max(wall, 1e-9):,.1f} tokens/s on "
                  f"{devices.describe(device)}, {scheduling} (plan: {' + '.join(plan.names) or 'baseline'}); set-up "
                  f"before that {setup_s:.1f} s (model, warm-up)",
                  highlight=False)
    recompiles = compiled_graphs() - graphs_before
    if recompiles:  # as `run` of any other plan says it
        console.print(f"warning: torch.compile compiled {recompiles} new graph(s) of the decode step during the run "
                      "(running batch sizes or cache lengths the warm-up did not meet: the batch shrinks as the last "
                      "prompts end); each costs seconds, counted in the tokens/s above", highlight=False)
    return 0


class _InOrder:
    """Writes completions to a JSONL file in input order, whatever order they end in: a completion waits until
    every record before it has been written (or refused)."""

    def __init__(self, out):
        self.out, self.written, self.tokens = out, 0, 0
        self._order: deque[int] = deque()  # input indices, in order, still to write
        self._ready: dict[int, str] = {}  # input index -> its line
        self._requests: dict[int, tuple[int, dict]] = {}  # a submitted request id -> (input index, record)

    def expect(self, request_id: int, index: int, record: dict) -> None:
        self._requests[request_id] = (index, record)
        self._order.append(index)

    def finish(self, request_id: int, completion) -> None:
        index, record = self._requests.pop(request_id)
        self._ready[index] = self._line(index, record, completion)

    def add(self, index: int, record: dict, completion) -> None:
        self._order.append(index)
        self._ready[index] = self._line(index, record, completion)

    def write_ready(self) -> None:
        while self._order and self._order[0] in self._ready:
            self.out.write(self._ready.pop(self._order.popleft()))
            self.written += 1
        self.out.flush()

    def _line(self, index: int, record: dict, c) -> str:
        self.tokens += c.completion_tokens
        keyed = {"index": index, **({"id": record["id"]} if "id" in record else {})}
        return json.dumps({**keyed, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                           "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens}) + "\n"


def _indices(path: Path) -> set[int]:
    """The record indices a (possibly cut-off) JSONL output already holds; a torn last line is dropped."""
    if not path.exists():
        return set()
    lines = path.read_text().split("\n")
    if lines and lines[-1]:  # a line the interrupted run did not finish
        path.write_text("\n".join(lines[:-1]) + ("\n" if len(lines) > 1 else ""))
        lines = lines[:-1]
    return {json.loads(line)["index"] for line in lines if line}


def _read_prompts(path: Path, field: str):
    """(index, record) for each line that is not blank (index: its line number from 0): a JSON object from .jsonl,
    the text itself from any other file; a line that is not JSON is a ValueError, refused by `_request`."""
    # Lines end at "\n" only: str.splitlines would also split at U+2028 and other separators a JSON string may hold.
    for index, line in enumerate(path.read_text(errors="replace").removesuffix("\n").split("\n")):
        line = line.removesuffix("\r")
        if not line.strip():  # a blank line is no record (its index is kept: indices are line numbers)
            continue
        if path.suffix == ".jsonl":
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as exc:
                yield index, ValueError(f"not JSON: {exc}")
        else:
            yield index, {field: line}


def _request(record, default: dict, field: str):
    """A record's prompt text and `SamplingParams` (its own max_tokens, temperature, top_p, top_k, seed, stop).

    Raises:
        ValueError: not an object, no text in `field`, a bad parameter (`SamplingParams`)."""
    from overdrive.generate.engine import SamplingParams

    if isinstance(record, Exception):
        raise ValueError(str(record))
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object with a {field!r} field, got {type(record).__name__}")
    if field not in record:
        raise ValueError(f"no field {field!r} (the prompt)")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"the prompt ({field!r}) must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"an empty prompt in field {field!r}")
    unknown = sorted(set(record) - set(PARAM_FIELDS) - {field, "id"})
    if unknown:
        raise ValueError(f"unknown fields {unknown}; known: {field}, id, {', '.join(PARAM_FIELDS)}")
    params = dict(default)
    params.update({PARAM_FIELDS[k]: v for k, v in record.items() if k in PARAM_FIELDS})
    try:
        return text, SamplingParams(**params)
    except ValueError as exc:  # in the record's own words: it said max_tokens
        if "max_new_tokens" in str(exc) and "max_tokens" in record:
            raise ValueError(str(exc).replace("max_new_tokens", "max_tokens")) from None
        raise
