// A small markdown renderer for answers and guidelines, safe by construction: it builds the page with
// createElement and text nodes only (never innerHTML), so HTML in an answer shows as characters, and links are
// shown as their text (no anchors, no images). Supported: fenced code blocks, tables, headings, lists, block
// quotes, paragraphs (line breaks kept), and inline `code`, **bold** and *emphasis*.
"use strict";

const MD = (() => {
  const el = (tag, parent, text) => {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  };

  // inline: `code`, **bold**, __bold__, *em*, _em_; everything else is text
  const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=\S)([^*]*?\S)\*|\b_(?=\S)([^_]*?\S)_\b/g;

  function inline(text, parent) {
    let last = 0;
    for (const match of text.matchAll(INLINE)) {
      if (match.index > last) parent.appendChild(document.createTextNode(text.slice(last, match.index)));
      if (match[1]) el("code", parent, match[2]);
      else if (match[3] !== undefined || match[4] !== undefined) inline(match[3] ?? match[4], el("strong", parent));
      else inline(match[5] ?? match[6], el("em", parent));
      last = match.index + match[0].length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  const cells = (line) => {
    let body = line.trim();
    if (body.startsWith("|")) body = body.slice(1);
    if (body.endsWith("|") && !body.endsWith("\\|")) body = body.slice(0, -1);
    return body.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  };
  const isRule = (line) => /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/.test(line) && line.includes("-");
  const FENCE = /^\s{0,3}(```+|~~~+)\s*([\w+-]*)\s*$/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const ITEM = /^\s{0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;

  function render(text, container) {
    container.replaceChildren();
    const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    let paragraph = null;
    const endParagraph = () => { paragraph = null; };
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        endParagraph();
        const code = [];
        i += 1;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
        i += 1;  // the closing fence (or the end)
        const block = el("code", el("pre", container, undefined), code.join("\n"));
        if (fence[2]) block.dataset.lang = fence[2];
        continue;
      }
      if (line.includes("|") && i + 1 < lines.length && isRule(lines[i + 1])) {
        endParagraph();
        const table = el("table", container);
        const head = el("tr", el("thead", table));
        for (const cell of cells(line)) inline(cell, el("th", head));
        const body = el("tbody", table);
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          const row = el("tr", body);
          for (const cell of cells(lines[i++])) inline(cell, el("td", row));
        }
        continue;
      }
      const heading = line.match(HEADING);
      if (heading) {
        endParagraph();
        inline(heading[2], el(`h${Math.min(heading[1].length + 2, 6)}`, container));
        i += 1;
        continue;
      }
      const item = line.match(ITEM);
      if (item) {
        endParagraph();
        const ordered = /\d/.test(item[1]);
        const list = el(ordered ? "ol" : "ul", container);
        if (ordered && parseInt(item[1], 10) !== 1) list.start = parseInt(item[1], 10);
        while (i < lines.length) {
          const next = lines[i].match(ITEM);
          if (next && /\d/.test(next[1]) === ordered) inline(next[2], el("li", list));
          else if (lines[i].trim() && /^\s{2,}/.test(lines[i]) && list.lastChild) {
            list.lastChild.appendChild(document.createTextNode(" "));
            inline(lines[i].trim(), list.lastChild);
          } else break;
          i += 1;
        }
        continue;
      }
      if (/^\s{0,3}>/.test(line)) {
        endParagraph();
        const quote = [];
        while (i < lines.length && /^\s{0,3}>/.test(lines[i])) quote.push(lines[i++].replace(/^\s{0,3}>\s?/, ""));
        render(quote.join("\n"), el("blockquote", container));
        continue;
      }
      if (!line.trim()) {
        endParagraph();
        i += 1;
        continue;
      }
      if (paragraph) paragraph.appendChild(document.createElement("br"));
      else paragraph = el("p", container);
      inline(line, paragraph);
      i += 1;
    }
  }

  return { render };
})();
