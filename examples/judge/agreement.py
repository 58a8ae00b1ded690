"""The judge against the task's own checker, on the same responses: how far its grades can be
trusted where no checker exists.

    python examples/judge/agreement.py examples/judge/addition.yaml [key=value ...] [--threshold 0.5]

1. The config's policy answers ``eval.num_tasks`` validation tasks ``eval.samples_per_task``
   times each (``asyncrl eval``, at ``eval.temperature``), every response scored by the task's
   own checker (``task.reward_fn`` set aside): ``OUTPUT_DIR/agreement/eval_samples.jsonl``.
2. The config's ``judge:`` grades each of those responses (its client's bound, deadline and
   retries); a call that fails is counted, not scored.
3. A response passes where its reward is at least ``--threshold``, for either rater; the
   confusion table, the agreement, chance's agreement and Cohen's kappa are printed and
   written, with each response's two verdicts, to ``OUTPUT_DIR/agreement/agreement.json``.

Exit 0 with figures; 2 for a usage error (no ``judge.url``, a bad config); 1 when the judge
graded nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from asyncrl.config import ConfigError, load_config
from asyncrl.frozen.agreement import Agreement, grade_all
from asyncrl.frozen.judge import JudgeReward, judge_from_config
from asyncrl.orchestrator.eval_command import EVAL_SAMPLES_FILE, run_eval
from asyncrl.tasks.from_config import build_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value, as for asyncrl train")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="a reward at least this passes, for the judge and the checker alike (default 0.5)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not cfg.judge.url:
            raise ConfigError("judge.url is not set: give the judge's server (judge.url=http://host:port)")
        out = Path(cfg.output_dir) / "agreement"
        # the task's own checker scores the responses: the config's reward function set aside
        checked = cfg.model_copy(update={"output_dir": str(out),
                                         "task": cfg.task.model_copy(update={"reward_fn": None,
                                                                             "reward_weights": None})})
        tasks = {t.id: t for t in build_tasks(checked).validation}
    except ConfigError as exc:
        print(f"agreement.py: error: {exc}", file=sys.stderr)
        return 2
    run_eval(checked)
    rows = [json.loads(line) for line in (out / EVAL_SAMPLES_FILE).read_text().splitlines() if line.strip()]
    scored = [r for r in rows if r["status"] == "ok"]
    judge = judge_from_config(cfg.judge)
    assert isinstance(judge, JudgeReward)

    async def grade():
        try:
            return await grade_all(judge, [(tasks[r["task_id"]], r["response"]) for r in scored])
        finally:
            await judge.model.close()

    grades = asyncio.run(grade())
    verdicts = [{"task_id": r["task_id"], "sample": r["sample"], "response": r["response"], "checker": r["reward"],
                 "judge": g.reward, "judge_error": g.error} for r, g in zip(scored, grades, strict=True)]
    judged = [v for v in verdicts if v["judge"] is not None]
    table = Agreement.from_pairs((v["judge"] >= args.threshold, v["checker"] >= args.threshold) for v in judged)
    failed = [v["judge_error"] for v in verdicts if v["judge"] is None]
    lines = [f"policy {cfg.model.path}: {len(rows)} responses ({len(rows) - len(scored)} failed episodes); "
             f"{judge.model}: {len(judged)} graded, {len(failed)} calls failed "
             f"({sum('no grade matching' in e for e in failed)} of them replies with no grade)"
             + (f" (the last: {failed[-1][:200]})" if failed else ""),
             f"pass: reward >= {args.threshold:g}", *table.lines()]
    print("\n".join(lines))
    summary = {"config": args.config, "overrides": args.overrides, "threshold": args.threshold,
               "responses": len(rows), "graded": len(judged), "judge_failures": len(failed),
               "both_pass": table.both_pass, "judge_only": table.judge_only, "checker_only": table.checker_only,
               "both_fail": table.both_fail, **{k: None if math.isnan(v) else v for k, v in
                                                 (("accuracy", table.accuracy), ("chance", table.chance),
                                                  ("kappa", table.kappa))},
               "verdicts": verdicts}
    (out / "agreement.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    print(f"written: {out / 'agreement.json'}", file=sys.stderr)
    return 0 if judged else 1


if __name__ == "__main__":
    sys.exit(main())
