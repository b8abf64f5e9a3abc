-- Load test of arserve's image generation with wrk (wrk 4):
--
--   wrk -t1 -c2 -d30s -s deploy/loadtest/arserve.lua http://127.0.0.1:8080/v1/images/generations
--   wrk ... -- linear 0.25      (every request asks for that KV policy and budget)
--
-- Each connection posts JSON bodies in a loop, cycling through the prompts
-- below. Statuses other than 200 are counted by status and the error.code of
-- the body ("429 queue_full" when the waiting queue is full, "503
-- server_draining" while the daemon drains) and printed at the end.
--
-- Latency: wrk measures each request from when it sends it, and a
-- connection sends its next request only after the last one is answered.
-- When the daemon slows down wrk sends fewer requests, so the time requests
-- would have waited is missing from its percentiles (coordinated omission).
-- `arserve bench` measures each request from the time it was scheduled to
-- start, the latency a client with a fixed arrival rate sees.
--
-- What to change: the prompts; the policy and budget after `--`; with an API
-- key, ARSERVE_API_KEY in the environment is sent as a bearer token.

local prompts = {
   "a red circle on the left",
   "two green triangles",
   "a blue square above a yellow diamond",
}

local extra = ""   -- the KV fields added to every body
local next_prompt = 1
counts = {}  -- "STATUS CODE" -> responses; a global, so done() can read it

function init(args)
   if args[1] then
      extra = string.format(', "kv_policy": "%s"', args[1])
   end
   if args[2] then
      extra = extra .. string.format(', "kv_budget": %s', args[2])
   end
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
   local key = os.getenv("ARSERVE_API_KEY")
   if key and key ~= "" then
      wrk.headers["Authorization"] = "Bearer " .. key
   end
end

local function json_string(s)
   return '"' .. s:gsub('[%c"\\]', function(c) return string.format("\\u%04x", c:byte()) end) .. '"'
end

function request()
   local prompt = prompts[next_prompt]
   next_prompt = next_prompt % #prompts + 1
   return wrk.format(nil, nil, nil, '{"prompt": ' .. json_string(prompt) .. extra .. '}')
end

function response(status, headers, body)
   if status ~= 200 then
      local code = body and body:match('"code"%s*:%s*"([^"]*)"') or "-"
      local k = status .. " " .. code
      counts[k] = (counts[k] or 0) + 1
   end
end

-- setup() runs for each thread before it starts: keep them, done() reads their counts.
local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

function done(summary, latency, requests)
   local total, lines = {}, {}
   for _, t in ipairs(threads) do
      for k, n in pairs(t:get("counts")) do
         total[k] = (total[k] or 0) + n
      end
   end
   local bad = 0
   for k, n in pairs(total) do
      bad = bad + n
      table.insert(lines, string.format("arserve: status %s: %d", k, n))
   end
   table.sort(lines)
   io.write(string.format("arserve: %d requests, %d not 200\n", summary.requests, bad))
   for _, line in ipairs(lines) do
      io.write(line .. "\n")
   end
end
