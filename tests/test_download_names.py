"""A download's `Content-Disposition` (RELIABILITY.md, Security): the uploaded name comes back without directory
parts, control or bidirectional-override characters, as RFC 6266's ASCII `filename` and UTF-8 `filename*`. A real
API process on loopback."""

from __future__ import annotations

import re
from urllib.parse import unquote

import pytest

from api.files.names import shown_name
from tests.conftest import free_port, start_api

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "laya", ' \
       b'"messages": [{"role": "user", "content": "hi"}]}}\n'
DISPOSITION = re.compile(r"""attachment; filename="([^"\\]*)"; filename\*=UTF-8''([A-Za-z0-9!#$&+\-.^_`|~%]+)""")


BOUNDARY = "kevlaya-test-boundary"


def multipart(name: str) -> bytes:
    """The upload's form with the name as raw UTF-8 bytes (HTTP clients would percent-encode its controls)."""
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + LINE + f"\r\n--{BOUNDARY}--\r\n".encode()


NAMES = [
    ("../../etc/\u202egnp.jsonl", "gnp.jsonl"),  # path parts and a right-to-left override
    ("..\\..\\evil\x00\x1b.jsonl", "evil.jsonl"),  # Windows separators, NUL and escape
    ("résumé \u200bbatch.jsonl", "résumé batch.jsonl"),  # a zero-width space dropped, accents kept
]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database plays no part here
def test_a_download_names_the_file_without_paths_or_hidden_characters(service_env, start_process):
    client = start_api(start_process, {**service_env, "KEVLAYA_API__PORT": str(free_port())})
    for uploaded, shown in NAMES:
        stored = client.post("/v1/files", content=multipart(uploaded),
                             headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
        assert stored.status_code == 200, stored.text
        assert stored.json()["filename"] == shown
        download = client.get(f"/v1/files/{stored.json()['id']}/content")
        assert download.status_code == 200 and download.content == LINE
        header = download.headers["content-disposition"]
        parsed = DISPOSITION.fullmatch(header)
        assert parsed, header
        ascii_name, encoded = parsed.groups()
        assert unquote(encoded, encoding="utf-8", errors="strict") == shown
        assert "/" not in ascii_name and ascii_name.isascii() and ascii_name.endswith(".jsonl")
    client.close()


def test_a_name_of_nothing_but_dots_and_separators_gets_a_plain_name():
    assert shown_name("../..") == shown_name("") == shown_name(None) == "upload.jsonl"
    assert shown_name("a/.hidden.jsonl") == "hidden.jsonl"  # no hidden file where it is saved
    assert shown_name("\u2066x\u2069\u202d.jsonl\u200f") == "x.jsonl"
