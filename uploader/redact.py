"""Secret-free URLs for log lines and error messages.

An endpoint may be written with credentials in it (``http://user:secret@minio:9000``) and request
URLs carry query strings (a presigned URL's is a credential); botocore repeats the full request URL
in its exception texts. Everything the uploader prints about a URL goes through here: the userinfo
becomes ``***@`` and a query string ``?***``, keeping scheme, host, port and path, which is what a
reader needs to see which server was meant.
"""
from __future__ import annotations

import re

REDACTED = "***"

# scheme://[userinfo@]rest[?query]. The userinfo runs to the LAST "@" before the path (a raw "@" in
# a password is common); once a ":" says a password follows, to the last "@" at all: a password may hold a
# raw "/", "?" or "#" too (AWS secret keys hold "/"), and a path with an "@" after a port is then hidden
# with it, the safe side. The query runs to the next blank or quote (URLs inside messages are quoted,
# by botocore with "..." or `...`).
_URL = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)"
    r"(?P<userinfo>[^\s/?#@'\"`<>]*:[^\s'\"`<>]*@|[^\s/?#'\"`<>]*@)?"
    r"(?P<rest>[^\s?'\"`<>]*)"
    r"(?P<query>\?[^\s'\"`<>]*)?"
)


def _replace(match: re.Match[str]) -> str:
    userinfo = f"{REDACTED}@" if match["userinfo"] else ""
    query = f"?{REDACTED}" if match["query"] else ""
    return f"{match['scheme']}{userinfo}{match['rest']}{query}"


def redact_text(text: str) -> str:
    """``text`` with the userinfo and query string of every ``scheme://...`` URL in it redacted."""
    return _URL.sub(_replace, text) if "://" in text else text


def redact_url(url: str) -> str:
    """One URL, redacted as redact_text does; a value without ``scheme://`` that still holds an
    ``@`` (``user:secret@host:9000``, a typo the config refuses) keeps only what follows the last one."""
    if "://" not in url and "@" in url:
        url = f"{REDACTED}@{url.rpartition('@')[2]}"
        if "?" in url:
            url = f"{url.partition('?')[0]}?{REDACTED}"
        return url
    return redact_text(url)


def redact_words(text: str) -> str:
    """``text`` as redact_text leaves it, and any other word that holds an ``@`` as redact_url does: a
    message that echoes a setting (botocore's "Invalid endpoint: user:secret@host:9000") may hold a
    credential without a scheme before it."""
    return " ".join(redact_url(word) if "@" in word and "://" not in word else word
                    for word in redact_text(text).split(" "))
