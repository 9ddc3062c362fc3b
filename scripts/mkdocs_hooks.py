"""MkDocs hooks of the documentation site (mkdocs.yml): the README as its front page, an API
reference of every name in ``ntkscope.__all__``, and the repository's files that the pages link
to outside docs/.

- ``index.md`` is README.md, its links into docs/ made site links.
- ``api.md`` lists ``ntkscope.__all__`` by stage and cse_models' public names, one mkdocstrings
  entry per name (at the module that defines it), so the reference and the public API cannot
  drift apart; a docstring's Sphinx roles become links to the entries (``on_page_content``).
- A link out of docs/ (``../figures/tail/figures/fig1a.png``, ``../benchmarks/README.md``) must
  name a file or folder of this checkout, else the build fails. Images and other files are
  copied into the site under ``repo/``; Markdown files and folders stay repository paths, shown
  as code (their own relative links belong to the repository, not to the site).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)  # a code block's text is code, not links


def _links(text: str, rewrite) -> str:
    """``text`` with ``rewrite`` applied to every Markdown link outside its code blocks."""
    out, at = [], 0
    for m in FENCE.finditer(text):
        out += [LINK.sub(rewrite, text[at:m.start()]), m[0]]
        at = m.end()
    return "".join(out + [LINK.sub(rewrite, text[at:])])
STAGES = (("ntkscope.core", "Core: errors, memory"), ("ntkscope.text", "Text: corpora, tokenizers, frequency, sentences"),
          ("ntkscope.kernel", "Kernel: gradients, NTK, eigenpairs, GC"), ("ntkscope.gc", "GC by group, in training"),
          ("ntkscope.representation", "Representations: clusters, router, plan"),
          ("ntkscope.runs", "Runs: checkpoints, families, embeddings"), ("ntkscope", "Reproduction and the rest"))


def _api_page() -> str:
    import ntkscope

    lines = ["# API reference", "",
             "Every name of `ntkscope.__all__` (`import ntkscope as ns; ns.NAME`), by stage, documented "
             "where it is defined. Helpers behind them stay importable from their modules.", ""]
    placed = set()
    for prefix, title in STAGES:
        names = [n for n in ntkscope.__all__ if n not in placed and ntkscope._EXPORTS[n].startswith(prefix)]
        if not names:
            continue
        lines += [f"## {title}", ""]
        for name in names:
            lines += [f"::: {ntkscope._EXPORTS[name]}.{name}", ""]
            placed.add(name)
    lines += ["## cse_models: CSE models, conversion in your own training, what the experts learned", "",
              "`cse_models.__all__`, and the names of its modules that a training script imports.", ""]
    lines += [f"::: {path}" for path in cse_models_names()] + [""]
    return "\n".join(lines)


#: cse_models' names beyond its __all__ that the guide's scripts import
CSE_MODULE_NAMES = ("cse_models.hf_trainer.SparseCallback", "cse_models.hf_trainer.convert_in_training",
                    "cse_models.expert_report.expert_report", "cse_models.train.train")


def cse_models_names() -> list:
    """The dotted paths of cse_models' public API, each where it is defined."""
    import cse_models

    names = [f"{getattr(cse_models, n).__module__}.{n}" for n in cse_models.__all__]
    return names + [n for n in CSE_MODULE_NAMES if n not in names]


ROLES = "func|class|meth|mod|data|attr|exc|obj"
ROLE = re.compile(rf":(?:{ROLES}):<code>(~?)([\w.\s]+?)(\(\))?</code>")
RAW_ROLE = re.compile(rf":(?:{ROLES}):`(~?)([\w.]+)`")  # inside a code element: the name alone


def on_page_content(html, page, config, files):
    """The API page: a docstring's Sphinx role (``:func:`~ntkscope.x```, rendered as text) made a
    link to the name's entry where the page has one, else its name as code."""
    if page.file.src_uri != "api.md":
        return html
    ids = set(re.findall(r'id="([\w.]+)"', html))

    def role(m):
        short, full = m[1] == "~", re.sub(r"\s+", "", m[2])  # a role broken over two lines of its docstring
        shown = (full.rsplit(".", 1)[-1] if short else full) + (m[3] or "")
        target = next((i for i in ids if i == full or i.endswith("." + full)), None)
        return f'<a href="#{target}"><code>{shown}</code></a>' if target else f"<code>{shown}</code>"

    html = ROLE.sub(role, html)
    return RAW_ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], html)


def _root(config) -> Path:
    """The checkout: the folder that holds docs/ (and README.md)."""
    return _normal(Path(config["docs_dir"])).parent


def _normal(path: Path) -> Path:
    """An absolute path with ``..`` folded, links not followed (a checkout may link its folders)."""
    return Path(os.path.normpath(os.path.abspath(path)))


def _readme_page(root: Path) -> str:
    """README.md with its links into docs/ as site links (the rest are left to :func:`on_page_markdown`)."""
    text = (root / "README.md").read_text()
    return _links(text, lambda m: f"{m[1]}[{m[2]}]({m[3][len('docs/'):]})" if m[3].startswith("docs/")
                  else f"{m[1]}[{m[2]}](../{m[3]})" if not re.match(r"[a-z]+:|#", m[3]) else m[0])


def on_files(files, config):
    root = _root(config)
    readme = _readme_page(root)
    files.append(File.generated(config, "index.md", content=readme))
    files.append(File.generated(config, "api.md", content=_api_page()))
    copied = set()
    docs = Path(config["docs_dir"])
    pages = [(docs / "index.md", readme), *((p, p.read_text()) for p in sorted(docs.glob("*.md")))]
    for path, text in pages:  # the README's links, made relative to docs/, as the pages'
        for m in LINK.finditer(FENCE.sub("", text)):
            target = _normal(path.parent / m[3].split("#")[0])
            if (m[3].startswith("../") and target.is_file() and target.is_relative_to(root)
                    and target.suffix != ".md" and target not in copied):
                copied.add(target)
                files.append(File.generated(config, f"repo/{target.relative_to(root).as_posix()}",
                                            abs_src_path=str(target)))
    return files


def on_page_markdown(markdown, page, config, files):
    def link(m):
        bang, label, target = m[1], m[2], m[3]
        path, _, anchor = target.partition("#")
        if not path.startswith("../"):
            return m[0]
        root = _root(config)
        full = _normal(Path(config["docs_dir"]) / path)
        rel = full.relative_to(root).as_posix() if full.is_relative_to(root) else path
        if not full.exists() or not full.is_relative_to(root):
            raise PluginError(f"{page.file.src_uri}: the link {target!r} names no file of the repository ({rel})")
        if full.is_file() and full.suffix != ".md":
            return f"{bang}[{label}](repo/{rel}{'#' + anchor if anchor else ''})"
        return f"{label} (`{rel}`)" if label.strip("`") != rel else f"`{rel}`"

    return _links(markdown, link)
