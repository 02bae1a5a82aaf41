// Drives `ferry mcp` (stdio) with the official TypeScript MCP SDK client:
// lists the tools, checks that no input schema has an idempotency key, calls
// create_order twice with one host key in _meta and checks the second
// answer is the same order, marked as a replay. Exits non-zero on any
// mismatch. Usage: node check.mjs /path/to/ferry
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const bin = process.argv[2];
const fail = (msg) => { console.error("FAIL: " + msg); process.exit(1); };

const transport = new StdioClientTransport({ command: bin, args: ["mcp"], env: process.env, stderr: "inherit" });
const client = new Client({ name: "ferry-ci-ts", version: "1.0.0" });
await client.connect(transport);

const { tools } = await client.listTools();
const names = tools.map((t) => t.name).sort();
for (const want of ["create_order", "intent_status", "send_reminder"]) {
  if (!names.includes(want)) fail(`tool ${want} not listed: ${names}`);
}
for (const t of tools) {
  if (JSON.stringify(t.inputSchema).toLowerCase().includes("idempotency") && t.name !== "intent_status") {
    fail(`${t.name}'s input schema mentions an idempotency key`);
  }
}
const create = tools.find((t) => t.name === "create_order");
if (create.annotations?.readOnlyHint !== false || create.annotations?.idempotentHint !== true || create.annotations?.destructiveHint !== false) {
  fail(`create_order annotations: ${JSON.stringify(create.annotations)}`);
}

const key = "ts-sdk-" + Date.now();
const call = () => client.callTool({
  name: "create_order",
  arguments: { user_id: "ts-agent", amount: 1500, currency: "JPY" },
  _meta: { "dev.ferry/idempotency-key": key },
});
const first = await call();
const second = await call();
if (first.isError || second.isError) fail(`create_order failed: ${JSON.stringify(first.content)} ${JSON.stringify(second.content)}`);
if (JSON.stringify(first.structuredContent) !== JSON.stringify(second.structuredContent)) fail("the replay answered another order");
if (second._meta?.["dev.ferry/replay"] !== true || first._meta?.["dev.ferry/replay"] !== false) fail(`replay marks: ${JSON.stringify(first._meta)} ${JSON.stringify(second._meta)}`);
const noKey = await client.callTool({ name: "create_order", arguments: { user_id: "ts-agent", amount: 1500, currency: "JPY" } });
if (!noKey.isError) fail("a call without a key was accepted");

await client.close();
console.log(`ok: TypeScript SDK client: ${tools.length} tools, order ${first.structuredContent.order_id} once, replay marked, keyless call refused`);
