
window.__reportErrors = [];
window.__reportError = function (msg) {
  window.__reportErrors.push(String(msg));
  var el = document.getElementById('js-errors');
  if (el) { el.textContent = window.__reportErrors.join('\n'); el.hidden = false; }
};
window.addEventListener('error', function (e) { window.__reportError('Uncaught ' + (e.message || e)); });
window.addEventListener('unhandledrejection', function (e) {
  window.__reportError('Unhandled rejection ' + (e.reason && e.reason.message || e.reason)); });
document.addEventListener('securitypolicyviolation', function (e) {
  window.__reportError('CSP blocked ' + e.violatedDirective + ' ' + (e.blockedURI || '')); });
(function () { var ce = console.error; console.error = function () {
  window.__reportError('console.error ' + Array.prototype.join.call(arguments, ' '));
  return ce.apply(console, arguments); }; })();
window.alert = function (m) { window.__reportError('alert() called: ' + m); };
