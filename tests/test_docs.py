"""/docs and /redoc work offline: the pages reference only the API's own URLs, and those answer."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from api.main import create_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    with TestClient(create_app()) as client:
        yield client


def referenced_urls(html: str) -> list[str]:
    return re.findall(r"""(?:src|href)=["']([^"']+)["']|url:\s*'([^']+)'|spec-url="([^"]+)\"""", html)


@pytest.mark.parametrize(("page", "script_marker"), [("/docs", "SwaggerUIBundle"), ("/redoc", "Redoc")])
def test_docs_page_loads_only_local_assets_and_they_answer(client: TestClient, page: str, script_marker: str):
    response = client.get(page)
    assert response.status_code == 200
    html = response.text
    urls = [next(u for u in match if u) for match in referenced_urls(html)]
    assert "/openapi.json" in urls
    scripts = re.findall(r'<script src="([^"]+)"', html)
    assert len(scripts) == 1
    assert not re.search(r"https?://|//cdn|fonts\.googleapis", html), "the page must not load anything remote"
    for url in urls:
        assert url.startswith("/"), url
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 0, url
    script = client.get(scripts[0])
    assert "javascript" in script.headers["content-type"]
    assert script_marker in script.text
    assert len(script.content) > 100_000  # the real bundle, not a stub


def test_swagger_ui_css_and_favicon_are_served_with_their_types(client: TestClient):
    html = client.get("/docs").text
    css = re.search(r'rel="stylesheet" href="([^"]+)"', html).group(1)
    icon = re.search(r'rel="shortcut icon" href="([^"]+)"', html).group(1)
    assert client.get(css).headers["content-type"].startswith("text/css")
    assert client.get(icon).headers["content-type"] == "image/png"
    assert client.get("/docs-assets/no-such-file.js").status_code == 404
