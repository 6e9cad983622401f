// proxyfleet console: live updates. The page works without this script;
// with it, the server's patches (Server-Sent Events at /live + the page's
// URL) replace the page's parts by element id, so it follows the fleet
// without reloading. The server coalesces its updates: a burst of changes
// sends at most a few patches a second, each replacing what it replaces.
(function () {
  "use strict";
  // Only the pages with live updates say so (sign-in, confirmation and
  // message pages have none).
  if (!window.EventSource || !document.body.hasAttribute("data-live")) {
    return;
  }
  var status = document.getElementById("live-status");
  function say(text, state) {
    // Only a change is written: the badge is a live region, and a screen
    // reader would repeat it at every patch otherwise.
    if (status && (status.getAttribute("data-state") !== state || status.textContent !== text)) {
      status.textContent = text;
      status.setAttribute("data-state", state);
    }
  }
  var es = new EventSource("/live" + location.pathname + location.search);
  es.addEventListener("open", function () {
    say("live", "live");
  });
  es.addEventListener("error", function () {
    say(es.readyState === EventSource.CLOSED ? "not live: reload for news" : "reconnecting…", "down");
  });
  es.addEventListener("patch", function (ev) {
    var patches;
    try {
      patches = JSON.parse(ev.data);
    } catch (e) {
      return;
    }
    if (!Array.isArray(patches)) {
      return;
    }
    for (var i = 0; i < patches.length; i++) {
      var el = document.getElementById(patches[i].id);
      if (!el) {
        continue;
      }
      // Keep the focus on a form a user is filling in.
      if (el.contains(document.activeElement) && document.activeElement.tagName === "INPUT") {
        continue;
      }
      var t = document.createElement("template");
      t.innerHTML = patches[i].html;
      el.replaceWith(t.content);
    }
    say("live", "live");
  });
})();
