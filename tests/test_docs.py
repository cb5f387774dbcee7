"""The front door holds: every relative link in README.md, docs/, each folder's README and
benchmarks/*.md names a file that exists and, where it names an anchor, a heading (or an explicit
id) of that file; every command of the README's and docs' bash blocks parses with its own CLI's
parser; every --flag a --help names exists; and each of the README's headline figures is a figure of
the benchmarks/RESULTS.md row it links."""
import contextlib
import json
import re

from conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
EXPLICIT_ID = re.compile(r"<a (?:id|name)=\"([^\"]+)\"")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors: each heading lower-cased, punctuation dropped, spaces as hyphens
    (repeats numbered), and explicit <a id> / <a name> targets."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCED.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(EXPLICIT_ID.findall(markdown))
    return found


def test_every_link_and_anchor_in_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md")),
             *sorted((REPO / "benchmarks").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in LINK.findall(CODE.sub("", text)):
            if re.match(r"[a-z]+:", target):  # http(s):, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---------------------------------------------------------------- the recipe's commands parse

COMMAND_PAGES = ("README.md", *[str(p.relative_to(REPO)) for p in sorted((REPO / "docs").glob("*.md"))])
# read by Slurm, the collectives' libraries or the shell, not by the repository's scripts
OUTSIDE_VARIABLES = {"PATH", "SLURM_CONF", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DS_ENV_FILE",
                     "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"}
SHELL_ONLY = {"source", "squeue", "scontrol", "salloc", "cd", "tail"}  # not ours, nothing to parse
SRUN_SWITCHES = {"--pty", "--exclusive", "-l", "--label", "--overlap"}  # srun's options that take no value


def shell_commands(markdown: str) -> list[list[str]]:
    """Each command of the page's ```bash blocks as words: continuation lines joined, comments
    and blank lines dropped."""
    import shlex
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return commands


def parse_or_run(words: list[str], capsys) -> str:
    """The command through its own CLI's parser (bert-plan estimate: run, it is cheap); the
    problem in one line, or "" when it parses."""
    import importlib
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    while words[:1] == ["sudo"] or words[:3] == ["ip", "netns", "exec"] or words[:1] == ["env"]:
        words = words[1:] if words[0] in ("sudo", "env") else words[4:]  # ip netns exec NAMESPACE
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
    if words[:1] == ["srun"]:  # srun's own options, then the command it runs, parsed as such
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1 if "=" in words[0] or words[0] in SRUN_SWITCHES else 2:]
        if not words:
            return ""
    program, args = words[0], words[1:]
    if program in SHELL_ONLY or (program.endswith("python") and args[:2] == ["-m", "pytest"]):
        return ""
    missing = [v for v in [*env.values(), *args] if v.startswith(("ds_configs/", "recipes/", "tools/", "benchmarks/"))
               and not any(c in v for c in "*{$") and not (REPO / v).is_file()]
    if missing:
        return f"no such file {missing}"
    if program in ("python", "python3", ".venv/bin/python") or any(a == "..." or "$" in a for a in args):
        return ""  # a script of the repository (it exists), or a line with placeholders: not parsed
    if program == "bash" or program == "sbatch":
        script = next((REPO / a for a in args if a.endswith((".sh", ".sbatch"))), None)
        if script is None or not script.is_file():
            return f"no script in {args}"
        texts = script.read_text() + (REPO / "recipes/slurm/pretrain.sbatch").read_text()
        unread = [name for name in env if name not in OUTSIDE_VARIABLES and not re.search(rf"\b{name}\b", texts)]
        return f"{script.name} reads no {unread}" if unread else ""
    try:
        if program == "bert-data-prep":
            importlib.import_module("data_prep.cli").build_parser().parse_args(args)
        elif program == "bert-finetune":
            importlib.import_module("commodity_bert.finetune.cli").build_parser().parse_args(args)
        elif program == "bert-ablate":
            importlib.import_module("commodity_bert.ablate.cli").parse_args(args)
        elif program == "bert-plan" and args[0] == "estimate" and "--profile" not in args:
            status = importlib.import_module("commodity_bert.plan.cli").main(args)
            out = capsys.readouterr().out
            return "" if status == 0 and "days" in out else f"exit {status}: {out[-300:]}"
        elif program == "bert-plan" and args[0] == "fit":
            status = importlib.import_module("commodity_bert.plan.cli").main(args)
            out = capsys.readouterr().out
            return "" if status == 0 and "micro-batch: " in out else f"exit {status}: {out[-300:]}"
        elif program == "bert-plan":
            importlib.import_module("commodity_bert.plan.cli").parse_args(args)
        elif program in ("bert-launch", "deepspeed"):
            launcher = importlib.import_module("commodity_bert.launch.launcher")
            _, ds_argv = launcher.split_argv(args)
            parsed = launcher.parse_deepspeed_args(ds_argv)
            if parsed.user_script == "train.py":
                importlib.import_module("train").parse_args(parsed.user_args)
            elif parsed.module:
                importlib.import_module("commodity_bert.plan.cli").parse_args(parsed.user_args)
        else:
            return f"a command the test does not know: {program} (add it to parse_or_run)"
    except importlib.import_module("commodity_bert.launch.launcher").UsageError as error:
        return f"refused by DeepSpeed's parser: {error}"
    except SystemExit as exit:
        return f"refused by its parser (exit {exit.code}): {capsys.readouterr().err.strip().splitlines()[-1:]}"
    return ""


def test_the_recipe_pages_commands_parse_with_their_own_clis(capsys):
    problems, checked = [], 0
    for page in COMMAND_PAGES:
        for words in shell_commands((REPO / page).read_text(encoding="utf-8")):
            checked += 1
            problem = parse_or_run(list(words), capsys)
            if problem:
                problems.append(f"{page}: {' '.join(words)[:120]}: {problem}")
    assert checked >= 20
    assert not problems, "\n".join(problems)


def options_of(parser) -> tuple[set[str], list[str]]:
    """A parser's options and its help texts (description, epilog, each option's), subcommands too."""
    import argparse
    options, texts = set(), [parser.description or "", parser.epilog or ""]
    for action in parser._actions:
        options.update(action.option_strings)
        if action.help and action.help != argparse.SUPPRESS:
            texts.append(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub_options, sub_texts = options_of(sub)
                options |= sub_options
                texts += sub_texts
    return options, texts


def deepspeed_parser(runner, monkeypatch):
    """The parser DeepSpeed's runner builds inside its parse_args, caught as it parses."""
    import argparse
    caught = []

    def catch(self, args=None, namespace=None):
        caught.append(self)
        raise SystemExit(0)
    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", catch)
        with contextlib.suppress(SystemExit):
            runner.parse_args(["train.py"])
    return caught[0]


def test_help_texts_name_only_options_that_exist(monkeypatch):
    """Each --flag a CLI's --help names is an option of one of the project's CLIs, of DeepSpeed's
    launcher or of sbatch (help texts point at each other's options), so a renamed or removed
    option cannot live on in another's help."""
    import importlib

    from commodity_bert.launch.launcher import deepspeed_runner
    parsers = {"train.py": importlib.import_module("train").build_parser(),
               "bert-data-prep": importlib.import_module("data_prep.cli").build_parser(),
               "bert-finetune": importlib.import_module("commodity_bert.finetune.cli").build_parser(),
               "bert-ablate": importlib.import_module("commodity_bert.ablate.cli").build_parser(),
               "bert-plan": importlib.import_module("commodity_bert.plan.cli").build_parser()}
    known = {"--stop_grace", "--partition", "--time", "--cpus-per-task", "--array"}  # bert-launch's own, sbatch's
    known |= options_of(deepspeed_parser(deepspeed_runner(), monkeypatch))[0]
    for parser in parsers.values():
        known |= options_of(parser)[0]
    unknown = []
    for name, parser in parsers.items():
        for text in options_of(parser)[1]:
            unknown += [f"{name}: {flag} in {text[:80]!r}" for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", text)
                        if flag not in known]
    assert not unknown, "\n".join(unknown)


# ---------------------------------------------------------------- the README's figures are the results page's

RESULT_LINK = re.compile(r"benchmarks/RESULTS\.md#([\w-]+)")
# a figure: 36%, 1.2–2.6×, 431×, 0.17, 1,134 s; not the digits of bf16, H200, 1-bit, 1e-3 or int4
FIGURE = re.compile(r"(?<![\w.])(?<!e-)\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?![\d.]*\d)(?!-?[A-Za-z])")


def figures(text: str) -> set[str]:
    """The numbers of a text, thousands' commas and en dashes normalised, link targets left out."""
    text = re.sub(r"\]\([^)]*\)", "]", text).replace("–", "-").replace("−", "-")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    return set(FIGURE.findall(text))


def anchored_rows(markdown: str) -> dict[str, str]:
    """Each explicit <a id> of a page and the text that carries it: its table row, or its
    paragraph (the lines between blank lines) where it is not in a table."""
    rows = {}
    for block in re.split(r"\n\s*\n", markdown):
        for line in block.splitlines():
            for anchor in EXPLICIT_ID.findall(line):
                rows[anchor] = line if line.lstrip().startswith("|") else block
    return rows


def test_the_readmes_headline_figures_are_the_results_pages():
    """Each row of the README's Results table links the row of benchmarks/RESULTS.md it comes from,
    and every number of its figure cell is a number of that row: a figure changed on one page and
    not on the other fails here."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")][2:]  # header, rule
    results = anchored_rows((REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8"))
    assert len(lines) >= 8
    problems = []
    for line in lines:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        ids = RESULT_LINK.findall(" ".join(cells[:2]))
        if not ids:
            problems.append(f"links no row of benchmarks/RESULTS.md: {line[:100]}")
            continue
        if ids[0] not in results:
            problems.append(f"benchmarks/RESULTS.md has no <a id=\"{ids[0]}\">: {line[:100]}")
            continue
        missing = sorted(figures(cells[1]) - figures(results[ids[0]]))
        if missing:
            problems.append(f"{ids[0]}: {missing} in the README, not in its RESULTS row")
    assert not problems, "\n".join(problems)


def test_the_planning_pages_on_paper_days_are_the_raw_jsons():
    """planning.md's on-paper table and slow_links.md's speed-up of 1-bit LAMB at 64 GPUs on
    1 Gbit/s are the rows of the raw JSON the table links, to the digits printed: a re-run plan
    that moves a figure fails here until the pages quote it."""
    planning = (REPO / "docs" / "planning.md").read_text(encoding="utf-8")
    section = planning.split('<a id="on-paper"></a>', 1)[1]
    raw = re.search(r"\[raw\]\(\.\./(benchmarks/results/[^)]+\.json)\)", section).group(1)
    rows = json.loads((REPO / raw).read_text())["rows"]

    def row(link: str, gpus: int, freeze: str) -> dict:
        return next(r for r in rows if r["link"] == link and r["gpus"] == gpus and r["log_every"] == 50
                    and r["freeze"].startswith(freeze))

    table = section.split("```", 2)[1].strip().splitlines()[1:]
    assert len(table) >= 4
    for line in table:
        rate, unit, gpus, lamb, auto, at_1000 = line.split()
        link = f"{rate}{unit.split('/')[0].lower()}"
        assert (lamb, auto, at_1000) == (f"{row(link, int(gpus), 'auto')['lamb_days']:.2f}",
                                         f"{row(link, int(gpus), 'auto')['onebit_days']:.2f}",
                                         f"{row(link, int(gpus), '1,000')['onebit_days']:.2f}"), line
    speedup = f"{row('1gbit', 64, 'auto')['speedup']:.2f}×"
    assert f"({speedup} at 64 GPUs with the shipped freeze)" in planning
    slow_links = (REPO / "docs" / "slow_links.md").read_text(encoding="utf-8")
    assert f"{speedup} faster than LAMB at 64 GPUs on paper" in slow_links


# phrases that tell how the project was made (a machine of its own, what was at hand, how work
# was done) rather than what it is; a user's machine is "yours" or named by its CPU
HOW_IT_WAS_MADE = re.compile(r"this machine's|this project's (?:CPU )?machine|was at hand|beside editing|"
                             r"notebook these|as the GPU machine|a borrowed|work session|gpu_carry", re.I)
ONE_MACHINES_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|root)/\S+")


def test_the_pages_speak_of_the_project_alone():
    """No page or config comment tells how the project was made, and no command on a page names
    one machine's own paths (a clone from /work/..., a home directory)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md")),
             *sorted((REPO / "benchmarks").glob("*.md")), *sorted((REPO / "ds_configs").glob("*.json"))]
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for match in (*HOW_IT_WAS_MADE.finditer(line), *ONE_MACHINES_PATH.finditer(line)):
                found.append(f"{page.relative_to(REPO)}:{number}: {match.group(0)}")
    assert not found, "\n".join(found)
