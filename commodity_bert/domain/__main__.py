"""python -m commodity_bert.domain check-text --text PATH... TASK FLAGS

TASK FLAGS are bert-finetune's (`--task embedded:polarity`, or `--train F --validation F` with
their field flags). Exits 0 with one line when no dev text of the task appears whole in the
pretraining inputs (files or directories as bert-data-prep reads them), or 2 with one line naming
the first found and its file (recipes/domain.sh runs it before anything is built)."""
from __future__ import annotations

import argparse
import sys

PROG = "python -m commodity_bert.domain check-text"


def main(argv: list[str] | None = None) -> int:
    from commodity_bert.finetune.cli import UsageError, build_parser, load_task
    from commodity_bert.finetune.tasks import TaskError
    from data_prep.errors import PrepError

    from commodity_bert.domain import overlap
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("check-text",))
    p.add_argument("--text", nargs="+", required=True, metavar="PATH", help="the pretraining inputs")
    args, task_flags = p.parse_known_args(argv)
    try:
        task = load_task(build_parser().parse_args(task_flags))
        if task.family != "classification":  # their dev units are contexts and word lists: not read here yet
            print(f"{PROG}: warning: reads classification tasks' dev texts; {task.name} is {task.family}: "
                  f"not checked", file=sys.stderr)
            return 0
        found = overlap.find_in_inputs(task, args.text)
    except (UsageError, TaskError, PrepError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if found:
        print(f"{PROG}: error: {len(found)} dev text(s) of {task.name} in the pretraining text, the first in "
              f"{found[0].where}: {found[0].dev_text[:80]!r}; remove those documents before pretraining",
              file=sys.stderr)
        return 2
    print(f"check-text: none of {task.name}'s {len(overlap.dev_texts(task)):,} dev texts in {' '.join(args.text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
