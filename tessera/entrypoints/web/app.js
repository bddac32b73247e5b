// Tessera's chat page: plain JS, no build step.
// The history keeps every image as a base64 JPEG <img> tag, every video clip as a base64 <video> tag and
// every recording as a base64 <audio> tag inside its message text (as the text-generation-webui does for
// images); when sending, each message is split back into OpenAI content parts (image_url, video_url,
// audio_url, text).
"use strict";

const $ = (id) => document.getElementById(id);
const chatHistory = [];       // {role: "user" | "assistant", content: string with <img> / <video> / <audio> tags}
let pending = [];          // {kind: "image" | "video" | "audio", src: data URL, name} attached to the next message
let modelName = null;
let busy = false;

const MEDIA_TAG = /<(img|video|audio)\s+src="(data:(image|video|audio)\/[a-z0-9.+-]+;base64,[A-Za-z0-9+/=]+)"\s*\/?>/g;
const TAG_NAME = {image: "img", video: "video", audio: "audio"};

// The media tags of `content` whose tag name matches their data URL's type, in order.
function* mediaTags(content) {
  for (const match of content.matchAll(MEDIA_TAG)) {
    const kind = match[1] === "img" ? "image" : match[1];
    if (kind === match[3]) yield {kind, src: match[2], index: match.index, length: match[0].length};
  }
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function mediaElement(kind, src) {
  if (kind === "image") {
    const img = document.createElement("img");
    img.src = src;
    img.alt = "attached image";
    return img;
  }
  if (kind === "audio") {
    const audio = document.createElement("audio");
    audio.src = src;
    audio.controls = true;
    audio.preload = "metadata";
    return audio;
  }
  const video = document.createElement("video");
  video.src = src;
  video.controls = true;
  video.muted = true;
  video.preload = "metadata";
  return video;
}

// Render a message: text stays text (never HTML); only our own data-URL <img> / <video> / <audio> tags become media.
function renderContent(element, content) {
  element.replaceChildren();
  let last = 0;
  for (const tag of mediaTags(content)) {
    if (tag.index > last) element.append(content.slice(last, tag.index));
    element.append(mediaElement(tag.kind, tag.src));
    last = tag.index + tag.length;
  }
  if (last < content.length) element.append(content.slice(last));
}

function addBubble(role, content) {
  const div = document.createElement("div");
  div.className = "message " + role;
  renderContent(div, content);
  $("history").append(div);
  div.scrollIntoView({block: "end"});
  return div;
}

// A history entry -> an OpenAI message with text, image_url, video_url and audio_url parts, in order.
function toApiMessage(entry) {
  if (entry.role !== "user") return {role: entry.role, content: entry.content};
  const parts = [];
  let last = 0;
  for (const tag of mediaTags(entry.content)) {
    const text = entry.content.slice(last, tag.index).trim();
    if (text) parts.push({type: "text", text});
    const type = tag.kind + "_url";
    parts.push({type, [type]: {url: tag.src}});
    last = tag.index + tag.length;
  }
  const rest = entry.content.slice(last).trim();
  if (rest) parts.push({type: "text", text: rest});
  return {role: "user", content: parts};
}

// Any image file -> a JPEG data URL (drawn on a canvas; large images scaled to 1024 px at most).
function toJpegDataUrl(file) {
  return new Promise((resolve, reject) => {
    const url = URL.createObjectURL(file);
    const img = new Image();
    img.onload = () => {
      const scale = Math.min(1, 1024 / Math.max(img.width, img.height));
      const canvas = document.createElement("canvas");
      canvas.width = Math.max(1, Math.round(img.width * scale));
      canvas.height = Math.max(1, Math.round(img.height * scale));
      const ctx = canvas.getContext("2d");
      ctx.fillStyle = "#fff";  // JPEG has no alpha: put transparent images on white
      ctx.fillRect(0, 0, canvas.width, canvas.height);
      ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
      URL.revokeObjectURL(url);
      resolve(canvas.toDataURL("image/jpeg", 0.92));
    };
    img.onerror = () => { URL.revokeObjectURL(url); reject(new Error(file.name + " is not an image this browser can read")); };
    img.src = url;
  });
}

// A video or audio file -> a data URL of its bytes as they are (the server samples a video's frames and
// decodes a recording itself).
function toDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(file.name + " could not be read"));
    reader.readAsDataURL(file);
  });
}

const MAX_MEDIA_MB = 20;  // a short clip or recording; the server has its own limits (and answers 413 over them)

async function attach(files) {
  for (const file of files) {
    try {
      if (file.type.startsWith("image/")) {
        pending.push({kind: "image", src: await toJpegDataUrl(file), name: file.name});
      } else if (file.type.startsWith("video/") || file.type.startsWith("audio/")) {
        const kind = file.type.split("/")[0];
        if (file.size > MAX_MEDIA_MB * 2 ** 20) { showError(file.name + " is over " + MAX_MEDIA_MB + " MB; attach a shorter " + (kind === "video" ? "clip." : "recording.")); continue; }
        pending.push({kind, src: await toDataUrl(file), name: file.name});
      } else {
        showError(file.name + " is not an image, a video or a recording.");
      }
    } catch (e) {
      showError(e.message);
    }
  }
  renderPending();
}

function renderPending() {
  const box = $("attachments");
  box.replaceChildren();
  pending.forEach((item, i) => {
    const wrap = document.createElement("div");
    wrap.className = "preview " + item.kind;
    wrap.title = item.name || "";
    const media = mediaElement(item.kind, item.src);
    media.controls = item.kind === "audio";  // a recording shows as its player; a clip as its first frame
    if (item.kind === "image") media.alt = "image to send";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "Remove";
    remove.onclick = () => { pending.splice(i, 1); renderPending(); };
    wrap.append(media);
    if (item.kind !== "image") {
      const name = document.createElement("span");
      name.className = "name";
      name.textContent = item.name || item.kind;
      wrap.append(name);
    }
    wrap.append(remove);
    box.append(wrap);
  });
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return "HTTP " + response.status;
  }
}

async function send() {
  const text = $("message").value.trim();
  if (busy || (!text && !pending.length)) return;
  showError("");
  const tags = pending.map((item) => `<${TAG_NAME[item.kind]} src="${item.src}">`);
  const content = tags.join("") + (pending.length && text ? "\n" : "") + text;
  const sent = pending;
  chatHistory.push({role: "user", content});
  const userBubble = addBubble("user", content);
  $("message").value = "";
  pending = [];
  renderPending();

  busy = true;
  $("send").disabled = true;
  const bubble = addBubble("assistant", "");
  bubble.classList.add("streaming");
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({
        model: modelName,
        messages: chatHistory.map(toApiMessage),
        stream: true,
        max_tokens: Number($("max-tokens").value) || 128,
        temperature: Number($("temperature").value) || 0,
      }),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, end).trim();
        buffer = buffer.slice(end + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : null;
        if (delta) {
          answer += delta;
          renderContent(bubble, answer.trimStart());
          bubble.scrollIntoView({block: "end"});
        }
      }
    }
    chatHistory.push({role: "assistant", content: answer.trimStart()});
  } catch (e) {
    // Drop the unanswered turn, so the next message starts from a consistent history, and give its
    // text and attachments back to the composer to fix (e.g. remove a video the model cannot take).
    chatHistory.pop();
    bubble.remove();
    userBubble.remove();
    if (!$("message").value) $("message").value = text;
    pending = sent.concat(pending);
    renderPending();
    showError("Error: " + e.message);
  } finally {
    bubble.classList.remove("streaming");
    busy = false;
    $("send").disabled = false;
  }
}

function clearChat() {
  chatHistory.length = 0;
  pending = [];
  renderPending();
  $("history").replaceChildren();
  showError("");
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", {headers: headers()});
    if (!response.ok) throw new Error(await errorMessage(response));
    modelName = (await response.json()).data[0].id;
    $("model-name").textContent = "model: " + modelName;
  } catch (e) {
    $("model-name").textContent = "model unavailable";
    showError("Could not reach the server: " + e.message);
  }
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
$("file-input").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
$("clear").addEventListener("click", clearChat);
$("api-key").value = localStorage.getItem("tessera-api-key") || "";
$("api-key").addEventListener("change", () => { localStorage.setItem("tessera-api-key", $("api-key").value); loadModel(); });

let dragDepth = 0;
document.addEventListener("dragenter", (e) => { e.preventDefault(); dragDepth++; $("drop-hint").hidden = false; });
document.addEventListener("dragleave", () => { if (--dragDepth <= 0) { dragDepth = 0; $("drop-hint").hidden = true; } });
document.addEventListener("dragover", (e) => e.preventDefault());
document.addEventListener("drop", (e) => {
  e.preventDefault();
  dragDepth = 0;
  $("drop-hint").hidden = true;
  attach(e.dataTransfer.files);
});

loadModel();
