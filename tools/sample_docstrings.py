"""The source text of the sample set (tools/build_sample_data.py): the public functions, classes and
methods of a fixed list of standard-library modules, each docstring cut into a query (its summary) and a document
(its body), deduplicated. Deterministic for one CPython release: every iteration is sorted."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings

MAX_DOC_CHARS = 1000
MIN_SUMMARY_WORDS, MIN_BODY_CHARS = 4, 60

# Fixed, sorted list of pure-Python stdlib modules that import without side effects.
MODULES = (
    "abc argparse ast base64 bdb calendar cmd code codeop compileall configparser "
    "contextlib csv dataclasses difflib dis doctest email.feedparser email.header "
    "email.headerregistry email.message email.policy email.utils enum filecmp fileinput "
    "fnmatch fractions ftplib functools getopt glob graphlib gzip hmac html.parser "
    "http.client http.cookiejar http.cookies http.server imaplib importlib.abc "
    "importlib.metadata importlib.util inspect ipaddress json.decoder json.encoder "
    "linecache locale logging logging.handlers lzma mailbox mimetypes modulefinder numbers "
    "optparse pathlib pdb pickle pickletools pkgutil platform plistlib poplib posixpath "
    "profile pstats py_compile pyclbr queue quopri random runpy sched secrets "
    "selectors shelve shutil smtplib socket socketserver statistics string subprocess "
    "symtable tarfile tempfile textwrap threading timeit tokenize trace traceback "
    "tracemalloc types typing unittest.case unittest.mock urllib.parse urllib.request uuid "
    "warnings wave weakref webbrowser wsgiref.handlers xml.dom.minidom "
    "xml.etree.ElementTree xml.sax.saxutils xmlrpc.client xmlrpc.server zipfile"
).split()
assert sorted(MODULES) == MODULES and len(set(MODULES)) == len(MODULES)


def own_doc(obj) -> str | None:
    """Docstring written on the object itself (inspect.getdoc would inherit a base's)."""
    raw = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.getdoc(obj) if isinstance(raw, str) and raw.strip() else None


def iter_documented(modname: str):
    """Yield (qid, group, docstring) for public functions, classes and their methods."""
    mod = importlib.import_module(modname)
    for name in sorted(vars(mod)):
        obj = vars(mod)[name]
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        # Only objects defined here under their own name: drops re-exports and aliases.
        if getattr(obj, "__module__", None) != modname or getattr(obj, "__qualname__", None) != name:
            continue
        if own_doc(obj):
            yield f"{modname}.{name}", modname, own_doc(obj)
        for mname, meth in sorted(vars(obj).items()) if inspect.isclass(obj) else ():
            meth = meth.__func__ if isinstance(meth, (classmethod, staticmethod)) else meth
            # public methods under their own name (skips aliases such as `x = y`)
            if (
                not mname.startswith("_")
                and inspect.isroutine(meth)
                and own_doc(meth)
                and getattr(meth, "__qualname__", None) == f"{name}.{mname}"
            ):
                yield f"{modname}.{name}.{mname}", f"{modname}.{name}", own_doc(meth)


def normalise_body(lines: list[str]) -> str:
    """Strip trailing spaces, drop outer blank lines, collapse blank-line runs to one."""
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text)


# End of a sentence: . ! ? followed by whitespace + capital/bracket/quote, or end of text.
SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z(\"'`]|\s*$)")
MAX_QUERY_CHARS = 300


def split_summary(doc: str) -> tuple[str, str]:
    """(query, body): the summary line, and the rest of the docstring.

    Many stdlib docstrings wrap their one-sentence summary over two or more lines;
    cutting at the first newline would leave a half sentence as the query and start
    the document mid-sentence. In that case the query is the first sentence of the
    first paragraph (joined onto one line) and the body starts right after it.
    """
    lines = doc.splitlines()
    first = lines[0].strip()
    if len(lines) > 1 and lines[1].strip() and not re.search(r"[.!?:]$", first):
        m = SENTENCE_END.search(doc.split("\n\n", 1)[0])  # within the first paragraph
        if m and m.end() <= MAX_QUERY_CHARS:
            query = " ".join(doc[: m.end()].split())
            rest = doc[m.end() :].lstrip(" ").removeprefix("\n")
            return query, normalise_body(rest.splitlines())
    return first, normalise_body(lines[1:])


def truncate(text: str, limit: int = MAX_DOC_CHARS) -> str:
    if len(text) <= limit:
        return text
    cut = max(text.rfind(" ", 0, limit + 1), text.rfind("\n", 0, limit + 1))
    return text[: cut if cut > 0 else limit].rstrip()


def collect_records() -> list[dict]:
    raw = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in MODULES:
            for qid, group, doc in iter_documented(modname):
                query, body = split_summary(doc)
                if len(query.split()) < MIN_SUMMARY_WORDS or len(body) < MIN_BODY_CHARS:
                    continue
                raw.append(
                    {"qid": qid, "module": modname, "group": group, "query": query, "doc": truncate(body), "full": doc}
                )
    # Deduplicate by docstring text and by document text; first by sorted qid wins.
    seen, records = set(), []
    for rec in sorted(raw, key=lambda r: r["qid"]):
        if rec["full"] not in seen and rec["doc"] not in seen:
            seen.update((rec["full"], rec["doc"]))
            records.append(rec)
    return records


if __name__ == "__main__":
    from lychee_exp.cli import library_module

    library_module(__spec__.name, __doc__, "tools.build_sample_data")
