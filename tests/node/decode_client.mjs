// A Node.js client of the verifier: Decode opens a session and streams its first tokens, Verify
// with no draft tokens adds one, Decode on the session streams the rest, CloseSession ends it.
//   node decode_client.mjs ADDRESS PROMPT_JSON COUNT        -> {"tokens", "positions", "session_opened"}
//   node decode_client.mjs ADDRESS PROMPT_JSON COUNT bad    -> a Decode naming both session_id and open
// A gRPC error prints its status code name and details to stderr and exits 1.
import { fileURLToPath } from "node:url";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const PROTO = fileURLToPath(new URL("../../proto/specdec/v1/verifier.proto", import.meta.url));
const FIRST = 3; // tokens of the opening Decode stretch

const [address, promptJson, countArg, mode] = process.argv.slice(2);
const prompt = JSON.parse(promptJson);
const count = Number(countArg);

const definition = protoLoader.loadSync(PROTO, { keepCase: true, longs: Number, defaults: true });
const { Verifier } = grpc.loadPackageDefinition(definition).specdec.v1;
const client = new Verifier(address, grpc.credentials.createInsecure());
const deadline = () => Date.now() + 30_000;

const unary = (method, request) =>
  new Promise((resolve, reject) =>
    client[method](request, { deadline: deadline() }, (err, reply) => (err ? reject(err) : resolve(reply))),
  );

async function decode(request) {
  const chunks = [];
  for await (const chunk of client.Decode(request, { deadline: deadline() })) chunks.push(chunk);
  return chunks;
}

const tokens = [];
const positions = [];
function commit(chunks) {
  for (const { tokens: got, position } of chunks) {
    got.forEach((token, i) => {
      tokens.push(token);
      positions.push(position - got.length + i + 1);
    });
  }
}

async function main() {
  const open = { prompt_tokens: prompt, vocab_size: 96 };
  if (mode === "bad") {
    await decode({ session_id: "x", open, max_tokens: 1 });
    throw new Error("a Decode naming both session_id and open was accepted");
  }
  const first = await decode({ open, max_tokens: FIRST });
  const opened = first[0]?.opened;
  const sessionOpened = opened != null && first.slice(1).every((c) => c.opened == null);
  commit(first);
  const session = opened.session_id;

  const reply = await unary("Verify", {
    session_id: session,
    base_position: positions.at(-1),
    draft_tokens: [],
  });
  tokens.push(reply.next_token);
  positions.push(reply.new_base_position);

  commit(await decode({ session_id: session, base_position: positions.at(-1), max_tokens: count - tokens.length }));
  await unary("CloseSession", { session_id: session });
  console.log(JSON.stringify({ tokens, positions, session_opened: sessionOpened }));
}

try {
  await main();
} catch (err) {
  if (err.code === undefined) throw err;
  const name = Object.keys(grpc.status).find((key) => grpc.status[key] === err.code);
  console.error(`${name} ${err.details}`);
  process.exitCode = 1;
} finally {
  client.close();
}
