"""MkDocs hooks of the documentation site (mkdocs.yml): the README as its front page, an API
reference of every name in ``ntkscope.__all__``, and the repository's files that the pages link
to outside docs/.

- ``index.md`` is README.md, its links into docs/ made site links.
- ``api.md`` lists ``ntkscope.__all__`` by stage, one mkdocstrings entry per name (at the module
  that defines it), so the reference and the public API cannot drift apart.
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
STAGES = (("ntkscope.core", "Errors"), ("ntkscope.text", "Text: corpora, tokenizers, frequency, sentences"),
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
    return "\n".join(lines)


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
