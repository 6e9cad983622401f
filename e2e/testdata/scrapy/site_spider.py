"""Crawls a site from its start page, following every link on it, and
yields one item per page: its URL, status and the X-Proxyfleet-Proxy header
the crawler gateway set (the proxy that carried the response) and its
X-Proxyfleet-Attempts (how many proxies it tried).

TestGatewayScrapy runs it with HTTP_PROXY naming the gateway:

    scrapy runspider site_spider.py -a start=http://127.0.0.1:PORT/ -o out.jsonl
"""

import scrapy


class SiteSpider(scrapy.Spider):
    name = "site"
    custom_settings = {
        # The test's site serves no robots.txt; asking for it would be one
        # request the site does not expect.
        "ROBOTSTXT_OBEY": False,
        "CONCURRENT_REQUESTS": 16,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
        # Every page is fetched exactly once: a failure is the test's
        # finding, not something to hide behind a retry.
        "RETRY_ENABLED": False,
        "DOWNLOAD_TIMEOUT": 30,
        # No listener of the crawler's own on a port it did not ask for.
        "TELNETCONSOLE_ENABLED": False,
        "LOG_LEVEL": "INFO",
    }

    def __init__(self, start=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not start:
            raise ValueError("give the start page: -a start=http://host:port/")
        self.start = start

    def start_requests(self):
        # Filtered like every other request (start_urls are not), so the
        # pages' links back to the start page do not fetch it again.
        yield scrapy.Request(self.start, callback=self.parse)

    def parse(self, response):
        proxy = response.headers.get("X-Proxyfleet-Proxy", b"").decode()
        attempts = int(response.headers.get("X-Proxyfleet-Attempts", b"0"))
        yield {"url": response.url, "status": response.status, "proxy": proxy, "attempts": attempts}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href, callback=self.parse)
