// The outbox console's few scripts. Every page works without them: the refresh is a reload,
// a confirmation is a page of its own, "select all" is ticking each box.
"use strict";

// Live figures: fetch the page again and swap its figures in place.
function refresh() {
  const page = document.getElementById("page");
  const seconds = page && Number(page.dataset.refresh);
  if (!seconds) return;
  setTimeout(async () => {
    try {
      const response = await fetch(location.href, { headers: { "X-Outbox-Refresh": "1" } });
      if (response.ok) {
        const doc = new DOMParser().parseFromString(await response.text(), "text/html");
        const fresh = doc.getElementById("page");
        // Keep an open disclosure open: refresh only while nothing is expanded.
        if (fresh && !page.querySelector("details[open]")) page.replaceWith(fresh);
      }
    } catch (_) {
      // The server is away for a moment: try again at the next turn.
    }
    refresh();
  }, seconds * 1000);
}

// Confirmations: a row's button asks about its row; "... selected" about the ticked rows.
document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-confirm], button[data-confirm-selected]");
  if (!button) return;
  const form = button.form;
  let question = button.dataset.confirm;
  if (button.dataset.confirmSelected !== undefined) {
    const ticked = document.querySelectorAll(`input[name=id][form="${form.id}"]:checked`).length;
    if (ticked === 0) {
      event.preventDefault();
      alert("Select at least one row first.");
      return;
    }
    question = ticked === 1
      ? button.dataset.confirmOne
      : button.dataset.confirmSelected.replace(/\b0\b/, String(ticked));
  }
  if (!confirm(question)) {
    event.preventDefault();
    return;
  }
  form.querySelector("input[name=confirmed]").value = "1";
});

// "Select all on this page".
document.addEventListener("change", (event) => {
  if (!event.target.matches("input.select-all")) return;
  for (const box of document.querySelectorAll("input[name=id][form=selection]")) {
    box.checked = event.target.checked;
  }
});

document.addEventListener("DOMContentLoaded", refresh);
