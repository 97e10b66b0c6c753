"""What tests/test_docs_truth.py checks, as plain functions on page text, so that each check can be shown to fail on
a small page that makes the mistake it guards against (the fixtures in that file).

A page is read in order: code blocks, inline code spans and prose. `import ringtrain.X as alias` (in a code block
or an inline span) binds `alias` from there on; before any import a page's `hvd` is the module the page is about
(its path says which: guides/keras.md is about ringtrain.keras, most pages about ringtrain.torch).
"""
import importlib
import itertools
import math
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------------------------
# reading a page


FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s")
LANGUAGES = {}      # page text -> {first line of a code block: its fence's language}


def blocks(text):
    """[(kind, text, first line number)] in page order: kind is "code" (a fenced block) or "prose" (a paragraph,
    a table, a list: consecutive non-blank lines outside code)."""
    out, buf, kind, start = [], [], None, 0
    languages = LANGUAGES.setdefault(text, {})
    for i, line in enumerate(text.splitlines(), 1):
        if kind == "code":
            if FENCE.match(line):
                out.append(("code", "\n".join(buf[1:]), start))
                languages[start] = buf[0]
                buf, kind = [], None
            else:
                buf.append(line)
            continue
        if FENCE.match(line):
            if buf:
                out.append(("prose", "\n".join(buf), start))
            buf, kind, start = [line.strip().lstrip("`~").strip()], "code", i + 1
        elif not line.strip() or HEADING.match(line):
            if buf:
                out.append(("prose", "\n".join(buf), start))
            buf, kind = [], None
            if HEADING.match(line):
                out.append(("heading", line, i))
        else:
            if not buf:
                start, kind = i, "prose"
            buf.append(line)
    if buf:
        out.append((kind or "prose", "\n".join(buf), start))
    return out


INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def inline_spans(prose):
    return [m.group(1) for m in INLINE.finditer(prose)]


def strip_code(prose):
    return INLINE.sub(" ", prose)


# ---------------------------------------------------------------------------------------------------------------
# names: every hvd.X / rt.X / ringtrain.X a page uses exists


PAGE_MODULE = {"guides/keras.md": "ringtrain.keras", "guides/tensorflow.md": "ringtrain.tensorflow",
               "guides/jax.md": "ringtrain.jax", "reference/keras.md": "ringtrain.keras",
               "reference/tensorflow.md": "ringtrain.tensorflow", "reference/jax.md": "ringtrain.jax"}
IMPORT = re.compile(r"\bimport\s+((?:ringtrain|horovod)(?:\.\w+)*)(?:\s+as\s+(\w+))?")
FROM_IMPORT = re.compile(r"\bfrom\s+((?:ringtrain|horovod)(?:\.\w+)*)\s+import\s+(\w+)(?:\s+as\s+(\w+))?")
DOTTED = re.compile(r"(?<![\w.\-/])([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)")


def page_module(relpath):
    relpath = relpath.replace(os.sep, "/")
    for suffix, module in PAGE_MODULE.items():
        if relpath.endswith(suffix):
            return module
    return "ringtrain.torch"


def used_names(text, default_module="ringtrain.torch"):
    """[(dotted name, line)]: every `alias.X...` whose alias is bound to a ringtrain module at that point of the page,
    read from code blocks and inline code; names bound to horovod are not ours and are left out."""
    aliases = {"hvd": default_module, "rt": "ringtrain"}
    found = []

    def scan(code, line):
        for statement in code.splitlines():
            for m in IMPORT.finditer(statement):
                module, alias = m.group(1), m.group(2)
                if alias:
                    aliases[alias] = module if module.startswith("ringtrain") else None
            for m in FROM_IMPORT.finditer(statement):
                module, name, alias = m.groups()
                if module.startswith("ringtrain"):
                    aliases[alias or name] = f"{module}.{name}"
                    found.append((f"{module}.{name}", line))
            for m in DOTTED.finditer(statement):
                head, rest = m.group(1), m.group(2)
                if head == "ringtrain":
                    found.append((head + rest, line))
                elif aliases.get(head):
                    found.append((aliases[head] + rest, line))

    for kind, body, line in blocks(text):
        if kind == "code":
            scan(body, line)
        elif kind == "prose":
            for span in inline_spans(body):
                scan(span, line)
    return found


class ExtraMissing(Exception):
    """The name lives in a binding whose framework is not installed (an absent extra)."""


def resolve(dotted):
    """True when `ringtrain.a.b.c` exists: the longest importable module prefix, then attributes. Raises ExtraMissing
    when a third-party framework the module needs is not installed."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("ringtrain"):
                raise ExtraMissing(e.name) from e
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# porting tables: a row says supported -> its names exist; not supported -> they do not


def tables(text):
    """[(header cells, [row cells])] of every markdown table."""
    out = []
    for kind, body, _ in blocks(text):
        if kind != "prose":
            continue
        lines = [ln for ln in body.splitlines() if ln.lstrip().startswith("|")]
        if len(lines) < 2 or not re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[1]):
            continue
        split = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]   # noqa: E731
        out.append((split(lines[0]), [split(ln) for ln in lines[2:]]))
    return out


PORTING_TARGET = {"horovod.torch": ("ringtrain.torch",),
                  "horovod.tensorflow (.keras)": ("ringtrain.tensorflow", "ringtrain.keras")}


def porting_rows(text):
    """[(names, status, ringtrain modules)] for every row of a table whose first header is a horovod module."""
    rows = []
    for header, body in tables(text):
        targets = PORTING_TARGET.get(header[0])
        if not targets:
            continue
        for cells in body:
            names = []
            for span in inline_spans(cells[0]):
                name = span.split("(")[0].strip()
                if not re.fullmatch(r"[A-Za-z_][\w.]*", name) or name.startswith(("horovod", "tf.")):
                    continue
                names.append(name)
            status = cells[1] if len(cells) > 1 else ""
            rows.append((names, status, targets))
    return rows


def porting_contradictions(text):
    """Messages for rows whose status the modules contradict. A name is looked up in the row's ringtrain modules
    (`keras.X` in ringtrain.keras); "not supported" rows must name nothing that exists."""
    wrong = []
    for names, status, targets in porting_rows(text):
        not_supported = status.lower().startswith("not supported")
        for name in names:
            if name.startswith("keras."):
                candidates = ["ringtrain." + name]
            else:                                  # a plain name is the first module's (horovod.tensorflow's)
                candidates = [f"{targets[0]}.{name}"]
            exists = [c for c in candidates if resolve(c)]
            if not_supported and exists:
                wrong.append(f"`{name}` is marked '{status}' but {exists[0]} exists")
            if not not_supported and not exists:
                wrong.append(f"`{name}` is marked '{status}' but none of {candidates} exists")
    return wrong


# ---------------------------------------------------------------------------------------------------------------
# a sentence that says which names a module keeps must be true of every module it names


MODULE_SENTENCE_NAMES = re.compile(r"keeps? Horovod's names(?: \(([^)]*)\)|:([^.]*))")


def module_sentence_contradictions(text):
    wrong = []
    for kind, body, _ in blocks(text):
        if kind != "prose":
            continue
        for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z`])", body):
            m = MODULE_SENTENCE_NAMES.search(sentence)
            if not m:
                continue
            modules = [s for s in inline_spans(sentence[:m.start()]) if re.fullmatch(r"ringtrain\.\w+", s)]
            for name in inline_spans(m.group(1) or m.group(2)):
                if not re.fullmatch(r"[A-Za-z_]\w*", name):
                    continue
                for module in modules:
                    if not resolve(f"{module}.{name}"):
                        wrong.append(f"'{sentence.strip()[:80]}...' says {module} keeps `{name}`; it has no such name")
    return wrong


# ---------------------------------------------------------------------------------------------------------------
# figures: every measured figure is in a results file its paragraph or section cites


def expand_braces(token):
    parts = re.split(r"\{([^}]*)\}", token)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def pattern_regex(token):
    """A regex for a file pattern as the results index writes them: nested {a,b} choices, {1..4} ranges, * globs."""
    out, i = [], 0
    while i < len(token):
        c = token[i]
        if c == "{":
            depth, j = 1, i + 1
            while depth:
                depth += {"{": 1, "}": -1}.get(token[j], 0)
                j += 1
            inner = token[i + 1:j - 1]
            m = re.fullmatch(r"(\d+)\.\.(\d+)", inner)
            if m:
                choices = [str(n) for n in range(int(m.group(1)), int(m.group(2)) + 1)]
                out.append("(?:" + "|".join(choices) + ")")
            else:
                parts, depth, start = [], 0, 0
                for k, ch in enumerate(inner):
                    depth += {"{": 1, "}": -1}.get(ch, 0)
                    if ch == "," and depth == 0:
                        parts.append(inner[start:k])
                        start = k + 1
                parts.append(inner[start:])
                out.append("(?:" + "|".join(pattern_regex(p) for p in parts) + ")")
            i = j
        elif c == "*":
            out.append(r"[\w.-]*")
            i += 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def listed_in_index(index_text):
    """Regexes of the files the results index lists (every code span that looks like a file name or pattern)."""
    spans = re.findall(r"`([\w.{},*-]+\.(?:txt|json|jsonl|png)|[\w.{},*-]+\.\{[\w,]+\})`", index_text)
    return [re.compile(pattern_regex(s) + "$") for s in spans]


def cited_results_files(text):
    tokens = re.findall(r"(?:benchmarks/)?results/([\w.{},-]+\.(?:txt|json|jsonl|png))", text)
    tokens += re.findall(r"`([\w{},-]+\.(?:txt|json|jsonl|\{[\w,]+\}))`", text)
    return {name for token in tokens for name in expand_braces(token) if "{" not in name and "}" not in name}


UNITS = r"x(?!\s*\d)|%|ms|us|µs|s|GB/s|TB/s|MB/s|steps/s|samples/s"
FIGURE = re.compile(r"(?<![\w.\-/])(\d+(?:\.\d+)?)(?:\s*(?:-|–|to)\s*(\d+(?:\.\d+)?))?\s?(" + UNITS + r")(?![\w/])")
CELL_NUMBER = re.compile(r"(?<![\w.\-/])(\d+\.\d+)(?![\w.])")
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


SOFTWARE_VERSION = re.compile(r"(?:Python|PyTorch|TensorFlow|Keras|MPICH|MPI|cupy|CUDA|JAX|jax|torch|Horovod|numpy|"
                              r"mpi4py|optax|Ray|Spark|pyspark|scikit-learn|ml_dtypes|mkdocs)[\s>=]*$")


def is_version(line, start):
    """A number that names a software version ("PyTorch 2.13"), not a measurement."""
    return bool(SOFTWARE_VERSION.search(line[max(0, start - 16):start]))


def figures(prose, tables_too=True):
    """Measured figures in prose (numbers with a unit: 1.67x, 94%, 0.21 s, 6.5 GB/s; both ends of a range) and, with
    `tables_too`, every decimal number in the cells of a table row."""
    text = strip_code(prose)
    found = []
    for line in text.splitlines():
        if line.lstrip().startswith("|") and tables_too:
            cells = line.strip().strip("|").split("|")[1:]        # the first cell names the row
            for cell in cells:
                found += [m.group(1) for m in CELL_NUMBER.finditer(cell) if not is_version(cell, m.start())]
        for m in FIGURE.finditer(line):
            if not is_version(line, m.start()):
                found += [g for g in m.groups()[:2] if g]
    return found


def file_numbers(name, cache={}):
    if name not in cache:
        path = os.path.join(RESULTS, name)
        text = read(path) if os.path.exists(path) and not name.endswith(".png") else ""
        cache[name] = (text, {float(n) for n in NUMBER.findall(text) if len(n) < 30})
    return cache[name]


def figure_in(figure, names):
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    value = float(figure)
    for name in names:
        text, numbers = file_numbers(name)
        if re.search(r"(?<![\d.])" + re.escape(figure) + r"(?![\d])", text):
            return True
        for n in numbers:
            for candidate in (n, n * 100, n / 1e3, n / 1e6):   # 94% as 0.94; 0.72 ms as 721 us; 100.7 M
                if abs(candidate - value) <= 0.5 * 10 ** -decimals * (1 + 1e-9):     # the figure rounds it
                    return True
    return False


def uncited_figures(text):
    """[(line, figure, files looked in)]: figures not found in the results files their paragraph (or, failing that,
    their section) cites. A figure with no results file cited around it at all is reported with no files."""
    wrong = []
    section_files = set()
    items = blocks(text)
    # a section's files: every file cited from its heading to the next heading
    sections, current = [], []
    for kind, body, line in items:
        if kind == "heading":
            sections.append(current)
            current = []
        current.append((kind, body, line))
    sections.append(current)
    for section in sections:
        section_files = set()
        for kind, body, _ in section:
            section_files |= cited_results_files(body)
        for kind, body, line in section:
            if kind != "prose":
                continue
            own = cited_results_files(body)
            # a table's decimals are figures where the section cites results (elsewhere: defaults, versions)
            for figure in figures(body, tables_too=bool(own | section_files)):
                look = (own | section_files)
                if not figure_in(figure, look):
                    wrong.append((line, figure, sorted(look)))
    return wrong


# ---------------------------------------------------------------------------------------------------------------
# the ringtrain-run flags a page uses exist


def launcher_flags_used(text):
    """Flags written after `ringtrain-run` (up to the command it runs), and the first cells of tables headed 'flag'."""
    flags = set()
    for kind, body, _ in blocks(text):
        chunks = body.splitlines() if kind == "code" else inline_spans(body)
        for chunk in chunks:
            for m in re.finditer(r"ringtrain-run((?:\s+(?!python\b|\.\/|bash\b|sh\b)\S+)*)", chunk):
                for token in m.group(1).split():
                    if token.startswith("python") or token in ("...", "command"):
                        break
                    if re.fullmatch(r"--?[A-Za-z][\w-]*", token):
                        flags.add(token)
        if kind == "prose":
            for header, rows in tables(body):
                if header[0].lower() == "flag":
                    for cells in rows:
                        for span in inline_spans(cells[0]):
                            flags.add(span.split()[0])
    return flags


def launcher_help_flags(help_text):
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text))


ELASTIC_SENTENCE = re.compile(r"makes? (?:the|a) job elastic")


def elastic_flag_claims(text):
    """[(sentence, flags named in it)] for every sentence that says which flags make a job elastic."""
    out = []
    for kind, body, _ in blocks(text):
        if kind != "prose":
            continue
        for sentence in re.split(r"(?<=[.;])\s+", body):
            if ELASTIC_SENTENCE.search(sentence):
                flags = {s.split()[0] for s in inline_spans(sentence) if s.startswith("-")}
                out.append((sentence.strip(), flags))
    return out


# ---------------------------------------------------------------------------------------------------------------
# version claims come from setup.py


PACKAGE_OF = {"python": "python", "pytorch": "torch", "torch": "torch", "tensorflow": "tensorflow-cpu",
              "keras": "keras", "jax": "jax", "optax": "optax", "mpi4py": "mpi4py", "pyspark": "pyspark",
              "spark": "pyspark", "ray": "ray", "mkdocs": "mkdocs"}
VERSION_CLAIM = re.compile(r"\b(Python|PyTorch|torch|TensorFlow|Keras|JAX|jax|optax|mpi4py|pyspark|Ray|ray|mkdocs)"
                           r"`?\s*(?:(?:>=|≥)\s*(\d+(?:\.\d+)+)|(\d+(?:\.\d+)+)(?:\+| or newer| or later))")


def setup_minimums(setup_text):
    mins = {}
    m = re.search(r'python_requires=">=([\d.]+)"', setup_text)
    if m:
        mins["python"] = m.group(1)
    for package, version in re.findall(r'"([A-Za-z][\w\-]*)(?:\[[\w,]+\])?>=([\d.]+)', setup_text):
        mins[package.lower()] = version
    return mins


def version_contradictions(text, mins):
    wrong = []
    for m in VERSION_CLAIM.finditer(text):
        package = PACKAGE_OF[m.group(1).lower()]
        claimed = m.group(2) or m.group(3)
        if package in mins and claimed != mins[package]:
            wrong.append(f"'{m.group(0)}': setup.py requires {package}>={mins[package]}")
    return wrong


# ---------------------------------------------------------------------------------------------------------------
# statements the code decides


def sentences(text):
    for kind, body, line in blocks(text):
        if kind != "prose":
            continue
        units, para = [], []
        for row in body.splitlines():
            if row.lstrip().startswith("|"):
                units += [cell for cell in row.strip().strip("|").split("|")]
            else:
                para.append(row)
        units.append(" ".join(para))
        for unit in units:
            for s in re.split(r"(?<=[.;])\s+(?=[A-Z(`*])", unit):
                if s.strip():
                    yield line, " ".join(s.split())


GRAD_VIEWS = re.compile(r"\.grad`?s? are (?:always )?views", re.IGNORECASE)
GRAD_VIEWS_QUALIFIED = re.compile(r"except|unless|large|set to None|refill|small", re.IGNORECASE)


def gradient_view_overclaims(text):
    """Sentences saying `.grad`s are views of the buckets without saying which are not (large gradients reduced
    after backward are refilled, and zero_grad() sets them to None)."""
    return [s for _, s in sentences(text) if GRAD_VIEWS.search(s) and not GRAD_VIEWS_QUALIFIED.search(s)]


WINDOW_DENIAL = re.compile(r"(?:never|cannot|can't|do(?:es)? not|not let)\b[^.]{0,40}\bshare (?:a |one )?memory window"
                           r"|(?:never|cannot|can't|do(?:es)? not|not let)\b[^.]{0,40}\bshare memory", re.IGNORECASE)


def memory_window_overclaims(text):
    """Sentences saying separately started (joined, elastic) processes cannot share memory without naming the MPICH
    network module where that holds (ucx): on ofi they do."""
    out = []
    for _, s in sentences(text):
        if WINDOW_DENIAL.search(s) and re.search(r"separately|joined|elastic|each worker|own MPI job|singleton", s,
                                                 re.IGNORECASE) and not re.search(r"\bucx\b", s):
            out.append(s)
    return out


STALE_GPU = re.compile(r"(?:has not|not yet|never)\s+(?:been\s+)?(?:run|measured|tested)\s+on a GPU", re.IGNORECASE)


def stale_gpu_claims(text, gpu_ran):
    """Sentences saying something has not run on a GPU although a GPU results file shows it did. `gpu_ran` lists
    what the GPU results files show ran (e.g. "gpu_train.py")."""
    out, section = [], ""
    items = blocks(text)
    for i, (kind, body, _) in enumerate(items):
        if kind == "heading" or i == 0:          # the section's text: what "the script" of a paragraph is
            section = ""
            for later in items[i + (kind == "heading"):]:
                if later[0] == "heading":
                    break
                section += later[1] + "\n"
        if kind != "prose":
            continue
        rows = [r for r in body.splitlines() if r.lstrip().startswith("|")]
        paragraph = " ".join(r for r in body.splitlines() if not r.lstrip().startswith("|"))
        # a table row is about what it names; a paragraph about what its section names
        for unit, about in [(r, r) for r in rows] + [(paragraph, section)]:
            if STALE_GPU.search(unit) and (any(name in about for name in gpu_ran)
                                           or re.search(r"\bnew code\b|\bthis code\b", unit)):
                out.append(" ".join(unit.split()))
    return out


def copy_fraction_claims(text):
    """[(low, high, exceptions)] for every 'N-M% of a (device-to-device) copy' claim; exceptions are the other
    percentages its sentence names ("except int8 Average at 62%")."""
    out = []
    for _, s in sentences(text):
        for m in re.finditer(r"(\d+(?:\.\d+)?)\s*[-–]\s*(\d+(?:\.\d+)?)%\s+of\s+a\s+(?:device-to-device\s+)?copy", s):
            others = {float(p) for p in re.findall(r"(?<![\d.–-])(\d+(?:\.\d+)?)%", s[m.end():])}
            out.append((float(m.group(1)), float(m.group(2)), others))
    return out


def copy_fraction_contradictions(text, measured):
    """Claims whose range leaves out a measured kernel that the sentence does not name as an exception."""
    wrong = []
    for low, high, others in copy_fraction_claims(text):
        outside = [v for v in measured if not low - 0.5 <= v < high + 0.5 and round(v) not in others]
        if outside:
            wrong.append(f"{low:g}-{high:g}% of a copy, but the results have {outside}")
    return wrong


def measured_copy_fractions(results_text):
    """Every reduction kernel's '% of copy' in a benchmarks/gpu_kernels.py table."""
    return [float(p) for p in re.findall(r"^reduce_\w+\s+\w+\s+\d+\s+[\d.]+\s+\d+\s+([\d.]+)%", results_text,
                                         re.MULTILINE)]


LAB_LOG = re.compile(r"heavy-run lock|\bA/B\b|\bABBA\b|\d{2}:\d{2}(?:-\d{2}:\d{2})? UTC|\bbefore the fix\b|"
                     r"\bChanged during development\b", re.IGNORECASE)


def lab_log_lines(text):
    return [line.strip() for line in text.splitlines() if LAB_LOG.search(line)]


OUTPUT_LINE = re.compile(r"^(?:epoch\s|final:|ranks \d)")


def unrecorded_output(text):
    """[(line, output line)]: lines of a program's output shown on a page (untagged code blocks with `epoch`/`final:`
    lines) that no results file cited in the same section holds verbatim."""
    wrong, files = [], set()
    items = blocks(text)
    languages = LANGUAGES.get(text, {})
    sections, current = [], []
    for item in items:
        if item[0] == "heading":
            sections.append(current)
            current = []
        current.append(item)
    sections.append(current)
    for section in sections:
        files = set()
        for kind, body, _ in section:
            if kind == "prose":
                files |= cited_results_files(body)
        texts = [file_numbers(name)[0] for name in files]
        for kind, body, line in section:
            if kind != "code" or languages.get(line) or not any(OUTPUT_LINE.match(x) for x in body.splitlines()):
                continue
            for out_line in body.splitlines():
                if out_line.strip() in ("", "...") or out_line.startswith("$"):
                    continue
                if not any(out_line.rstrip() in t for t in texts):
                    wrong.append((line, out_line))
    return wrong


GPU_POINTER = re.compile(r"\bGPU\b[^.]{0,60}\b(?:numbers|figures|measurements|results)\b|"
                         r"\b(?:numbers|figures|measurements|results)\b[^.]{0,30}\bGPUs?\b", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def gpu_pointers_to_pages_without_gpu_results(text, page_path):
    """Sentences that send the reader to other pages for the GPU numbers: one page they link must cite a GPU
    results file (benchmarks/results/gpu_*), or the pointer leads to no GPU figure at all."""
    wrong = []
    for _, sentence in sentences(text):
        if not GPU_POINTER.search(sentence):
            continue
        targets = [t for t in LINK.findall(sentence)
                   if os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page_path), t)))]
        if targets and not any(name.startswith("gpu") for t in targets for name in cited_results_files(
                read(os.path.normpath(os.path.join(os.path.dirname(page_path), t))))):
            wrong.append(f"{', '.join(targets)} (linked for the GPU numbers) cite no gpu_* results file")
    return wrong


FIT_ERROR = re.compile(r"\b(?:fit|fitted)\b[^.]{0,80}\berrors?\b|\berrors?\b[^.]{0,40}\bfit\b", re.IGNORECASE)


def model_without_its_fit_error(text):
    """A page that quotes a fitted model's projections (a results file with a max_fit_err column, and a sentence
    that projects a percentage) must say how far the fit is from the measurements: the projections are only as good
    as the fit. (An index that only describes the file quotes nothing.)"""
    if not any("project" in sentence and "%" in sentence for _, sentence in sentences(text)):
        return []
    fitted = [name for name in cited_results_files(text) if name.endswith((".txt", ".json"))
              and os.path.exists(os.path.join(RESULTS, name)) and "max_fit_err" in read(os.path.join(RESULTS, name))]
    return fitted if fitted and not FIT_ERROR.search(strip_code(text)) else []
