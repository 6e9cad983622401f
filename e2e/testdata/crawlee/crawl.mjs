// Crawls a site from its start page through the crawler gateway with
// Crawlee's CheerioCrawler and its SessionPool, each Crawlee session mapped
// to a gateway session (<pool>.session-<id>), and writes one JSON line per
// page: its URL, status and the X-Proxyfleet-Proxy and
// X-Proxyfleet-Attempts headers the gateway set.
//
// TestGatewayHTTPSCrawl runs it with NODE_EXTRA_CA_CERTS naming the
// gateway's CA certificate (and the site's), so certificates are verified:
//
//   node crawl.mjs --start https://127.0.0.1:PORT/ --gateway 127.0.0.1:8888 \
//       --pool demo --out out.jsonl
import { appendFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { CheerioCrawler, ProxyConfiguration, Configuration } from '@crawlee/cheerio';

const { values: args } = parseArgs({
    options: {
        start: { type: 'string' },
        gateway: { type: 'string' },
        pool: { type: 'string' },
        password: { type: 'string', default: 'x' },
        out: { type: 'string' },
    },
});
for (const k of ['start', 'gateway', 'pool', 'out']) {
    if (!args[k]) {
        console.error(`crawl.mjs: --${k} is required`);
        process.exit(2);
    }
}

const proxyConfiguration = new ProxyConfiguration({
    // Crawlee's session ids ("session_AbC…") are valid gateway session ids.
    newUrlFunction: (sessionId) => `http://${args.pool}.session-${sessionId}:${args.password}@${args.gateway}`,
});

const crawler = new CheerioCrawler({
    proxyConfiguration,
    useSessionPool: true,
    persistCookiesPerSession: false,
    // Certificates are verified: the gateway's CA comes from
    // NODE_EXTRA_CA_CERTS. (Crawlee ignores TLS errors by default.)
    ignoreSslErrors: false,
    maxConcurrency: 16,
    // Every page is fetched exactly once: a failure is the test's
    // finding, not something to hide behind a retry.
    maxRequestRetries: 0,
    requestHandlerTimeoutSecs: 30,
    navigationTimeoutSecs: 30,
    async requestHandler({ request, response, enqueueLinks }) {
        appendFileSync(args.out, JSON.stringify({
            url: request.loadedUrl ?? request.url,
            status: response.statusCode,
            proxy: response.headers['x-proxyfleet-proxy'] ?? '',
            attempts: Number(response.headers['x-proxyfleet-attempts'] ?? 0),
        }) + '\n');
        await enqueueLinks({ strategy: 'same-origin' });
    },
    failedRequestHandler({ request }, error) {
        appendFileSync(args.out, JSON.stringify({ url: request.url, status: 0, error: String(error) }) + '\n');
    },
}, new Configuration({ persistStorage: false }));

await crawler.run([args.start]);
