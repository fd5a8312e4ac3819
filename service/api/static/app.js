// The console's shell: the token form, the navigation and the router (#/chat, #/tasks,
// #/tasks/<id>, #/server). Each page is a module with mount(main) -> unmount().

import { api, setToken, token, Unauthorized } from "./api.js";
import { errorText, field, h } from "./dom.js";
import * as chat from "./chat.js";
import { forgetChat } from "./chat.js";
import * as server from "./server.js";
import * as tasks from "./tasks.js";

const main = document.getElementById("main");
const signout = document.getElementById("signout");
let unmount = null;

function tokenForm(reason) {
  const input = h("input", { id: "token", name: "token", type: "password", autocomplete: "current-password", required: true });
  const error = h("p", { class: "error", role: "alert" }, reason || "");
  const form = h("form", { class: "card token-form", "aria-labelledby": "token-title" },
    h("h1", { id: "token-title" }, "Sign in"),
    h("p", {}, "This server needs an access token (one of its server.tokens). It is kept in this tab only and sent as a bearer header."),
    field("Access token", input),
    error,
    h("button", { type: "submit" }, "Sign in"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    setToken(input.value.trim());
    try {
      await api("/lmsp/v1/capabilities");
      forgetChat(); // whatever this browser kept before is not this token's
      route();
    } catch (err) {
      setToken("");
      error.textContent = err instanceof Unauthorized ? "That token was refused." : errorText(err);
      input.focus();
    }
  });
  return { form, input };
}

function showTokenForm(reason) {
  if (unmount) unmount();
  unmount = null;
  const { form, input } = tokenForm(reason);
  main.replaceChildren(form);
  signout.hidden = true;
  input.focus();
}

document.addEventListener("lmspd:unauthorized", () => {
  const had = Boolean(token());
  setToken("");
  forgetChat();
  if (!main.querySelector(".token-form")) showTokenForm(had ? "That token is no longer accepted." : "");
});

signout.addEventListener("click", () => {
  setToken("");
  forgetChat(); // the system prompt and turn ids are the token's: the next person never sends them
  // Not location.hash: its hashchange would route after the form is shown, mount the chat page
  // without a token, and replace the form (and what was typed into it) on the 401.
  history.replaceState(null, "", "#/chat");
  showTokenForm("");
});

function route() {
  if (unmount) unmount();
  unmount = null;
  const path = location.hash.replace(/^#/, "") || "/chat";
  const parts = path.split("/").filter(Boolean);
  let page = chat;
  let arg = null;
  if (parts[0] === "tasks") {
    page = tasks;
    arg = parts[1] ? decodeURIComponent(parts[1]) : null;
  } else if (parts[0] === "server") {
    page = server;
  }
  for (const link of document.querySelectorAll("nav a")) {
    const current = link.dataset.page === (parts[0] || "chat");
    if (current) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  signout.hidden = !token();
  main.replaceChildren();
  unmount = page.mount(main, arg);
}

window.addEventListener("hashchange", route);
route();
