// troupe's LLaMA-3 and LLaMA-2 tokenizers (data/llama3, data/llama2: tokenizer.json files made by
// scripts/make_tokenizers.mjs) against the npm reference encoders they were converted from,
// llama3-tokenizer-js@1.2.0 and llama-tokenizer-js@1.2.2, id for id: on slices of the corpus and
// on crafted text (CJK, emoji, combining marks, whitespace runs, digits, contractions, special
// tokens). troupe's ids come from the built binary (`troupe tokenize`), which also checks that
// decoding gives back every input's bytes.
//
// Usage: node tests/model/tokenizer_reference_test.mjs TROUPE_BINARY SOURCE_DIR
// Fails with a hint when node's packages or the tokenizer files are missing (scripts/setup.sh).
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const [troupe, root] = process.argv.slice(2);
if (!troupe || !root) {
  console.error('usage: node tokenizer_reference_test.mjs TROUPE_BINARY SOURCE_DIR');
  process.exit(2);
}
const data = path.join(root, 'data');
const need = [
  path.join(data, 'npm/llama3-tokenizer-js-1.2.0/bundle/llama3-tokenizer-with-baked-data.js'),
  path.join(data, 'npm/llama-tokenizer-js-1.2.2/llama-tokenizer.js'),
  path.join(data, 'llama3/tokenizer.json'),
  path.join(data, 'llama2/tokenizer.json'),
  path.join(data, 'raw/moby-dick/data/data.txt'),
];
for (const f of need) {
  if (!fs.existsSync(f)) {
    console.error(`tokenizer_reference: error: ${f} is missing\n  hint: run scripts/setup.sh ` +
                  '(it fetches the npm reference tokenizers and writes data/llama3, data/llama2)');
    process.exit(1);
  }
}
const llama3 = (await import(pathToFileURL(need[0]))).default;
const llama2 = (await import(pathToFileURL(need[1]))).default;

// Crafted text: every kind of character class the pre-tokenizers and merges treat differently.
const crafted = [
  'Hello world, this is a test.',
  'CJK: 我们今天去公园散步。東京は晴れです。서울의 날씨는 맑습니다.',
  'Emoji: 👋🌍 🧑‍🚀 family 👨‍👩‍👧‍👦 flags 🇫🇮🇯🇵 and ❤️‍🔥!!',
  'Combining marks: e\u0301 a\u0308 n\u0303 \u0915\u093f \u05e9\u05c1\u05b8 Z\u0351\u0352\u0353',
  'Whitespace runs:  two   three    four\t\ttabs\n\nnewlines\r\n\r\nCRLF \n  \n   end   ',
  '   leading spaces and trailing spaces      ',
  'Digits: 1 12 123 1234 12345 3.14159 1,000,000 2026-12-01 0x1F ١٢٣ ５６',
  "Contractions: I'm you're he's we've they'll she'd can't IT'S I'M YOU'RE O'Neil 'quoted'",
  'Punctuation: ...!!! ??? --- ___ *** ### $$$ %%% &&& ((( ))) [] {} <> /\\ ~~ ``',
  'Mixed: naïve café résumé Ærøskøbing straße ǅungla İstanbul ΑΒΓ αβγ Жжж',
  'Code: for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n\tif (x != y) return -1;',
  'URLs: https://example.org/path?q=1&r=two#frag user@example.com',
  'Rare: \u{1F9EA}\u{10348}\u{1D11E} \u2028 \u00a0nbsp\u00a0 \u3000ideographic\u3000space',
];
// Special tokens written in the text: LLaMA-3's encoder matches them, LLaMA-2's reads text only.
const llama3Specials = [
  '<|begin_of_text|>Hello<|eot_id|>',
  'a <|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|><|start_header_id|>assistant',
  'reserved <|reserved_special_token_5|> and <|reserved_special_token_247|>, not <|fake|> or <|eot_id',
];
const llama2Specials = ['<s>Hello</s> world', 'a <s> b </s>c <unk> d', '<s>'];

// Corpus slices: the start of Moby Dick and of a few addresses, cut at a character boundary.
function slice(file, bytes) {
  const text = fs.readFileSync(file, 'utf8');
  return text.slice(0, bytes);
}
const corpus = [slice(need[4], 60000)];
const sotu = path.join(data, 'raw/sotu/data');
for (const f of fs.readdirSync(sotu).filter((n) => n.endsWith('.txt')).sort().filter((_, i) => i % 60 === 0)) {
  corpus.push(slice(path.join(sotu, f), 15000));
}

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'troupe_tokref_'));
let passed = 0;
let failed = 0;

function troupeIds(tokenizer, texts) {
  const files = texts.map((t, i) => {
    const f = path.join(tmp, `${path.basename(tokenizer)}_${i}.txt`);
    fs.writeFileSync(f, t);
    return f;
  });
  const out = execFileSync(troupe, ['tokenize', '--tokenizer', tokenizer, ...files],
                           { encoding: 'utf8', maxBuffer: 1 << 28 });
  return out.trim().split('\n').map((l) => JSON.parse(l));
}

function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; ++i) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}

function compare(label, texts, reference, roundTrip) {
  const got = troupeIds(path.join(data, label), texts);
  texts.forEach((text, i) => {
    const want = reference(text);
    const mine = got[i].ids;
    const at = firstDifference(mine, want);
    const name = `${label} #${i} (${text.length} chars, ${want.length} tokens)`;
    if (at >= 0) {
      failed++;
      console.log(`FAIL ${name}: first difference at token ${at}: troupe ` +
                  `${JSON.stringify(mine.slice(Math.max(0, at - 3), at + 5))} vs reference ` +
                  `${JSON.stringify(want.slice(Math.max(0, at - 3), at + 5))}; text ` +
                  `${JSON.stringify(text.slice(0, 80))}`);
    } else if (roundTrip && !got[i].round_trip) {
      failed++;
      console.log(`FAIL ${name}: ids match but decoding them does not give back the text`);
    } else {
      passed++;
      console.log(`ok   ${name}`);
    }
  });
}

// LLaMA-2 reads special-token text as text; Hugging Face's file matches <s>, </s>, <unk> first and
// normalizes each remaining segment on its own (prepending U+2581 to each): the reference for such
// text is the npm encoder on each segment, with the special ids between.
function llama2WithSpecials(text) {
  const ids = [];
  for (const part of text.split(/(<s>|<\/s>|<unk>)/)) {
    if (part === '<s>') ids.push(1);
    else if (part === '</s>') ids.push(2);
    else if (part === '<unk>') ids.push(0);
    else if (part.length > 0) ids.push(...llama2.encode(part, false, true));
  }
  return ids;
}

compare('llama3', [...crafted, ...llama3Specials, ...corpus],
        (t) => llama3.encode(t, { bos: false, eos: false }), true);
compare('llama2', [...crafted, ...corpus], (t) => llama2.encode(t, false, true), true);
const specials2 = troupeIds(path.join(data, 'llama2'), llama2Specials);
llama2Specials.forEach((text, i) => {
  const want = llama2WithSpecials(text);
  const at = firstDifference(specials2[i].ids, want);
  if (at >= 0) {
    failed++;
    console.log(`FAIL llama2 specials #${i}: troupe ${JSON.stringify(specials2[i].ids)} vs ${JSON.stringify(want)}`);
  } else {
    passed++;
    console.log(`ok   llama2 specials #${i} (${want.length} tokens)`);
  }
});

fs.rmSync(tmp, { recursive: true, force: true });
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed === 0 && passed > 0 ? 0 : 1);
